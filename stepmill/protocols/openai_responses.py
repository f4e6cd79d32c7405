"""OpenAI Responses (/v1/responses) over HTTP, SSE and WebSocket.

A request may carry only the new input plus ``previous_response_id``; the addon rebuilds
the full conversation from the responses it has seen (see ``stepmill.pipeline.ingest``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from stepmill.protocols.base import (AssistantBuilder, Completion, ParsedRequest, ProtocolError, canonical_content,
                                     tool_call, usage_of)
from stepmill.protocols.contract import Protocol

# WebSocket frames, recognised on the event loop without parsing them: the one that starts a turn
# and the ones that end it.
CREATE_FRAME = re.compile(rb'^\s*\{.{0,200}?"type"\s*:\s*"response\.create"', re.S)
TERMINAL_FRAME = re.compile(rb'"type"\s*:\s*"(?:response\.(?:completed|failed|incomplete)|error)"')


def is_create_frame(content: bytes) -> bool:
    return bool(CREATE_FRAME.match(content))


def is_terminal_frame(content: bytes) -> bool:
    return bool(TERMINAL_FRAME.search(content))


API = "openai.responses"


def _usage(raw):
    return usage_of(raw, input_key="input_tokens", output_key="output_tokens",
                    cache_read=("input_tokens_details", "cached_tokens"))


def _output_text(value: Any) -> Any:
    if isinstance(value, list):
        return canonical_content(value)
    return "" if value is None else value


def canonical_items(items: list) -> list[dict]:
    """Input or output items as canonical messages; consecutive assistant items merge into one turn."""
    out: list[dict] = []
    builder: AssistantBuilder | None = None

    def flush():
        nonlocal builder
        if builder is not None and not builder.empty():
            out.append(builder.message())
        builder = None

    def assistant() -> AssistantBuilder:
        nonlocal builder
        if builder is None:
            builder = AssistantBuilder()
        return builder

    for item in items:
        if not isinstance(item, dict):
            raise ProtocolError("input items must be objects")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            content = canonical_content(item.get("content"))
            if role == "assistant":
                text = content if isinstance(content, str) else "".join(
                    p.get("text", "") for p in content if isinstance(p, dict))
                assistant().text.append(text)
            else:
                flush()
                out.append({"role": role, "content": content})
        elif kind == "reasoning":
            summary = "".join(p.get("text", "") for p in item.get("summary") or [] if isinstance(p, dict))
            detail = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
            assistant().reasoning.append(detail or summary)
        elif kind == "function_call":
            assistant().calls.append(tool_call(item.get("call_id"), item.get("name"), item.get("arguments") or ""))
        elif kind == "custom_tool_call":
            assistant().calls.append(tool_call(item.get("call_id"), item.get("name"), item.get("input") or ""))
        elif kind == "local_shell_call":
            assistant().calls.append(tool_call(item.get("call_id"), "local_shell", item.get("action") or {}))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            flush()
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _output_text(item.get("output"))})
        # other item types (web search calls, item references, ...) stay in the wire form only
    flush()
    return out


def input_items(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return value
    raise ProtocolError("'input' must be a string or a list of items")


def parse_request(body: dict, api: str = API) -> ParsedRequest:
    items = input_items(body.get("input"))
    messages = canonical_items(items)
    if body.get("instructions"):
        messages.insert(0, {"role": "system", "content": canonical_content(body["instructions"])})
    params = {k: v for k, v in body.items() if k not in ("input", "tools", "type")}
    metadata = body.get("client_metadata") if isinstance(body.get("client_metadata"), dict) else {}
    return ParsedRequest(
        api=api,
        model=body.get("model"),
        stream=bool(body.get("stream")),
        params=params,
        tools=body.get("tools"),
        messages=messages,
        wire_messages=items,
        previous_response_id=body.get("previous_response_id"),
        session_id=metadata.get("session_id") or metadata.get("conversation_id"),
        generate=body.get("generate", True) is not False,
    )


def _finish_reason(response: dict) -> str | None:
    status = response.get("status")
    if status == "incomplete":
        return (response.get("incomplete_details") or {}).get("reason") or "incomplete"
    if status == "failed":
        return "failed"
    if any(isinstance(i, dict) and i.get("type") in ("function_call", "custom_tool_call", "local_shell_call")
           for i in response.get("output") or []):
        return "tool_calls"
    return "stop" if status == "completed" else status


def raw_message_ids(response: dict) -> tuple[list[int] | None, list[int] | None, str | None]:
    """vLLM's exact ids of a Responses call (``enable_response_messages``): the prompt's tokens in
    ``input_messages``, the sampled ones in ``output_messages``, as ``raw_message_tokens`` items
    (their tokens are the truth, not their text). One turn each, or the ids are not taken (a note)."""
    def tokens(key: str) -> list | None:
        items = response.get(key)
        if not isinstance(items, list):
            return None
        raw = [i for i in items if isinstance(i, dict) and i.get("type") == "raw_message_tokens"]
        return [i.get("tokens") for i in raw] if raw else None

    prompt, output = tokens("input_messages"), tokens("output_messages")
    if prompt is None or output is None:
        return None, None, None
    if len(prompt) != 1 or len(output) != 1:
        return None, None, (f"the engine ran {len(output)} turns inside one Responses call (builtin tools): "
                            "its raw tokens are not one prompt and one response, so no ids were taken")
    ids = [prompt[0], output[0]]
    if not all(isinstance(part, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in part) for part in ids):
        return None, None, "the engine's raw_message_tokens are not token ids; none were taken"
    return ids[0], ids[1], None


def completion_from_response(response: dict) -> Completion:
    output = response.get("output")
    if not isinstance(output, list):
        raise ProtocolError("response has no 'output' list")
    messages = canonical_items(output)
    message = messages[-1] if messages and messages[-1]["role"] == "assistant" else {"role": "assistant", "content": ""}
    status = {"completed": "ok", "incomplete": "incomplete", "failed": "error"}.get(response.get("status"), "ok")
    error = response.get("error")
    prompt_ids, response_ids, note = raw_message_ids(response)
    return Completion(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        notes=[note] if note else [],
        message=message,
        wire=output,
        finish_reason=_finish_reason(response),
        usage=_usage(response.get("usage")),
        response_id=response.get("id"),
        model=response.get("model"),
        status=status,
        error=json.dumps(error) if error else (None if status == "ok" else f"response {response.get('status')}"),
    )


def parse_response(body: dict, api: str = API) -> Completion:
    if "error" in body and "output" not in body:
        return Completion(status="error", error=json.dumps(body["error"]))
    return completion_from_response(body)


class StreamAssembler:
    """Rebuilds a response from its stream events (SSE ``data:`` or WebSocket frames)."""

    def __init__(self, api: str = API):
        self.response: dict = {}
        self.items: dict[int, dict] = {}
        self.text: dict[int, list[str]] = {}
        self.final: dict | None = None
        self.error = None
        self.output_started = False
        self.notes: list[str] = []

    @property
    def terminal(self) -> bool:
        return self.final is not None or self.error is not None

    def feed(self, event: str | None, data: str) -> None:
        self.feed_parsed(event, json.loads(data))

    def feed_parsed(self, event: str | None, payload) -> None:
        """One event, already parsed (the writer parses a stream's events in one pass)."""
        if not isinstance(payload, dict):
            raise ProtocolError("stream event is not a JSON object")
        self.feed_event(payload)

    def feed_event(self, payload: dict) -> None:
        kind = payload.get("type") or ""
        if kind in ("response.created", "response.in_progress", "response.queued"):
            self.response = payload.get("response") or self.response
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.final = payload.get("response") or {}
        elif kind == "error":
            self.error = json.dumps(payload.get("error") or payload)
        elif kind in ("response.output_item.added", "response.output_item.done"):
            self.items[payload.get("output_index", len(self.items))] = payload.get("item") or {}
            self.output_started = True
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta",
                      "response.custom_tool_call_input.delta", "response.reasoning_summary_text.delta",
                      "response.reasoning_text.delta", "response.refusal.delta"):
            self.text.setdefault(payload.get("output_index", 0), []).append(payload.get("delta") or "")
            self.output_started = True
        elif not kind.startswith("response."):
            self.notes.append(f"unknown stream event type {kind!r}")

    def finish(self) -> Completion:
        if self.final is not None:
            completion = completion_from_response({**self.final, "output": self.final.get("output") or
                                                   [self.items[i] for i in sorted(self.items)]})
        else:
            # Cut short: keep what arrived, finished items whole and deltas of the unfinished one.
            output = []
            for index in sorted(set(self.items) | set(self.text)):
                item = dict(self.items.get(index) or {"type": "message", "role": "assistant"})
                partial = "".join(self.text.get(index, []))
                if item.get("type") == "function_call" and not item.get("arguments"):
                    item["arguments"] = partial
                elif item.get("type") == "message" and not item.get("content") and partial:
                    item["content"] = [{"type": "output_text", "text": partial}]
                output.append(item)
            completion = completion_from_response({**self.response, "output": output, "status": "incomplete"})
            completion.status = "error" if self.error else "incomplete"
            completion.error = self.error or "stream ended before response.completed"
        if self.notes and completion.status == "ok":
            completion.status, completion.error = "error", "; ".join(self.notes)
        completion.notes = completion.notes + list(self.notes)
        return completion


# Codex's ChatGPT login speaks it at /codex/responses; a WebSocket upgrade there is a connection of turns.
PROTOCOL = Protocol(api=API, path=r"/(v1|codex)/responses$", parse_request=parse_request,
                    parse_response=parse_response, StreamAssembler=StreamAssembler, websocket=True,
                    engine_ids="responses")
