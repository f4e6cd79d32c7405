"""Shared shapes for the protocol parsers: a parsed request, a parsed completion."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def json_bytes(value: Any) -> bytes:
    """JSON for the wire; ASCII escapes where the value holds text UTF-8 cannot carry (lone surrogates)."""
    try:
        return json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(value).encode()


class ProtocolError(ValueError):
    """A body that does not have the shape its protocol promises."""


@dataclass
class ParsedRequest:
    api: str
    model: str | None = None
    stream: bool = False
    params: dict = field(default_factory=dict)  # everything but the conversation and the tools
    tools: list | None = None
    messages: list[dict] = field(default_factory=list)  # canonical
    wire_messages: list = field(default_factory=list)
    previous_response_id: str | None = None
    session_id: str | None = None
    generate: bool = True  # False for a Responses warm-up that only primes the connection
    prompt_ids: list | None = None  # token ids the request itself gave the engine (token in)


@dataclass
class Completion:
    message: dict | None = None  # canonical assistant message
    wire: list = field(default_factory=list)  # the completion as the protocol carries it
    finish_reason: str | None = None
    usage: dict | None = None
    response_id: str | None = None
    model: str | None = None
    status: str = "ok"
    error: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    notes: list[str] = field(default_factory=list)  # what did not parse cleanly
    token_provenance: str | None = None  # where the ids came from when not the engine's own answer (rendered)
    # Choices 1..n-1 of a request with n > 1: more rollouts of the same prompt, one step each.
    alternatives: list["Completion"] = field(default_factory=list)


def load_json_object(body: bytes | str, what: str) -> dict:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} is JSON but not an object")
    return value


def canonical_content(content: Any) -> Any:
    """Content as chat templates take it: a string when it is all text, else a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict):
                kind = part.get("type")
                if kind in ("text", "input_text", "output_text") or (kind is None and "text" in part):
                    parts.append({"type": "text", "text": _text_of_part(part, "text")})
                elif kind in ("image_url", "input_image", "image"):
                    parts.append({"type": "image", "image": part.get("image_url") or part.get("source") or part})
                elif kind == "refusal":
                    parts.append({"type": "text", "text": _text_of_part(part, "refusal")})
                else:
                    parts.append(part)
        if all(p.get("type") == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    return str(content)


def _text_of_part(part: dict, key: str) -> str:
    text = part.get(key) or ""
    if not isinstance(text, str):
        raise ProtocolError(f"a {key} part's {key} is {type(text).__name__}, not a string")
    return text


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class AssistantBuilder:
    """Merges the pieces of one assistant turn (text, thinking, tool calls) into a canonical message."""

    def __init__(self):
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []

    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.calls)

    def message(self) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = list(self.calls)
        return message


def usage_of(raw: dict | None, *, input_key: str, output_key: str, cache_read: tuple = (), cache_write: tuple = ()) -> dict | None:
    if not isinstance(raw, dict):
        return None

    def dig(path: tuple):
        value: Any = raw
        for key in path:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value

    return {
        "input_tokens": raw.get(input_key),
        "output_tokens": raw.get(output_key),
        "cache_read_tokens": dig(cache_read) if cache_read else None,
        "cache_write_tokens": dig(cache_write) if cache_write else None,
        "raw": raw,
    }


class DoneTerminatedStream:
    """What the assemblers of streams that end in ``data: [DONE]`` share (OpenAI chat and completions,
    SGLang's /generate): the end marker, and parsing each other event before ``feed_parsed``."""

    done = False
    error: str | None = None

    @property
    def terminal(self) -> bool:
        return self.done or self.error is not None

    def feed(self, event: str | None, data: str) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        self.feed_parsed(event, json.loads(data))

    def feed_parsed(self, event: str | None, chunk) -> None:
        raise NotImplementedError
