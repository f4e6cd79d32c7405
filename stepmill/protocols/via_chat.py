"""What the translations through an engine's chat completions share (messages_via_chat, gemini_via_chat):
a tool call's arguments back as an object, an engine's error message, a request refused at the edge, and
the reading of its chunks."""

from __future__ import annotations

import json
from typing import Any

from stepmill.protocols.sse import Event


def tool_arguments(arguments: Any) -> dict:
    """A chat tool call's arguments (a JSON string) as the object the agent's protocol carries."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"_unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def error_message(payload: Any) -> tuple[str, bool]:
    """An engine's error: its message, and whether it came as an ``error`` object."""
    error = payload.get("error") if isinstance(payload, dict) else None
    message = (error.get("message") if isinstance(error, dict) else None) or (
        payload.get("message") if isinstance(payload, dict) else None) or json.dumps(payload)[:2000]
    return message, isinstance(error, dict)


class Malformed(ValueError):
    """A request of a shape the agent's own API refuses too (a field of the wrong type): the proxy answers it
    with a 400 in the agent's protocol, and the engine never sees it."""


def refusal(via: Any, reason: str) -> bytes:
    """The proxy's own 400 for a request it cannot translate, in the agent's protocol (``via``: its translation
    module): the reason named, and that stepmill, not the engine, said it."""
    return json.dumps(via.error_body({"error": {"message": f"stepmill refused this call: {reason}"}}, 400),
                      ensure_ascii=False).encode()


def not_carried(notes: list[str], where: str, names: list[str], why: str = "") -> None:
    """A note that ``names`` (fields of ``where``, or values) do not reach the engine."""
    if names:
        verb = "is" if len(names) == 1 else "are"
        notes.append(f"{where}{', '.join(names)} {verb} not carried by the engine's chat completions{why}")


class ChatStreamTranslator:
    """Chat completion chunks in, another protocol's stream out: ``on_chunk(chunk)`` for each chunk,
    ``on_error(chunk)`` for an error chunk (the end), ``close()`` at ``[DONE]`` or when the body ends."""

    done = False
    finished = False  # the engine said the stream is whole ([DONE])

    def __call__(self, event: Event) -> bytes:
        if self.done or not event.data:
            return b""
        if event.data.strip() == "[DONE]":
            self.finished = True
            return self.close()
        try:
            chunk = json.loads(event.data)
        except ValueError:
            return b""
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk and "choices" not in chunk:
            self.done = True
            return self.on_error(chunk)
        return self.on_chunk(chunk)

    def on_chunk(self, chunk: dict) -> bytes:
        raise NotImplementedError

    def on_error(self, chunk: dict) -> bytes:
        raise NotImplementedError

    def close(self) -> bytes:
        raise NotImplementedError
