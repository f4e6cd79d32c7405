"""Anthropic Messages (/v1/messages): text, tool_use, thinking with signatures, redacted thinking."""

from __future__ import annotations

import json
import re
from typing import Any

from stepmill.protocols.base import (AssistantBuilder, Completion, ParsedRequest, ProtocolError, canonical_content,
                                     tool_call, usage_of)
from stepmill.protocols import messages_via_chat
from stepmill.protocols.contract import Protocol

API = "anthropic.messages"
KNOWN_EVENTS = {
    "message_start", "content_block_start", "content_block_delta", "content_block_stop",
    "message_delta", "message_stop", "ping", "error",
}
TEXT_FIELDS = ("text", "thinking", "signature")  # block fields built from deltas
_SESSION = re.compile(r"session[_-]?([0-9A-Za-z-]{8,})")


def _usage(raw):
    return usage_of(raw, input_key="input_tokens", output_key="output_tokens",
                    cache_read=("cache_read_input_tokens",), cache_write=("cache_creation_input_tokens",))


def _tool_result_text(content: Any) -> Any:
    if isinstance(content, list):
        return canonical_content(content)
    return "" if content is None else content


def assistant_from_blocks(blocks: list) -> dict:
    builder = AssistantBuilder()
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            builder.text.append(block.get("text") or "")
        elif kind == "thinking":
            builder.reasoning.append(block.get("thinking") or "")
        elif kind in ("tool_use", "server_tool_use"):
            builder.calls.append(tool_call(block.get("id"), block.get("name"), block.get("input") or {}))
        # redacted_thinking and other opaque blocks live in the wire form only
    return builder.message()


def canonical_messages(system: Any, messages: list) -> list[dict]:
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": canonical_content(system)})
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ProtocolError(f"message content must be a string or a list of blocks, not {type(content).__name__}")
        if role == "assistant":
            out.append(assistant_from_blocks(content))
            continue
        rest = []
        for block in content:
            if not isinstance(block, dict):
                raise ProtocolError(f"a content block must be an object, not {type(block).__name__}")
            if block.get("type") == "tool_result":
                tool = {"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": _tool_result_text(block.get("content"))}
                if block.get("is_error"):
                    tool["is_error"] = True
                out.append(tool)
            else:
                rest.append(block)
        if rest:
            out.append({"role": role, "content": canonical_content(rest)})
    return out


def parse_request(body: dict, api: str = API) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ProtocolError("messages request has no 'messages' list of objects")
    params = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    user_id = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    session = None
    if isinstance(user_id, str):
        match = _SESSION.search(user_id)
        if match:
            session = match.group(1)
        else:
            try:  # newer Claude Code sends a JSON string with a session_id field
                session = (json.loads(user_id) or {}).get("session_id")
            except (ValueError, AttributeError):
                session = None
    return ParsedRequest(
        api=api,
        model=body.get("model"),
        stream=bool(body.get("stream")),
        params=params,
        tools=body.get("tools"),
        messages=canonical_messages(body.get("system"), messages),
        wire_messages=messages,
        session_id=session,
    )


def parse_response(body: dict, api: str = API) -> Completion:
    if body.get("type") == "error":
        return Completion(status="error", error=json.dumps(body.get("error")))
    content = body.get("content")
    if not isinstance(content, list):
        raise ProtocolError("message response has no 'content' list")
    return Completion(
        message=assistant_from_blocks(content),
        wire=[{"role": "assistant", "content": content}],
        finish_reason=body.get("stop_reason"),
        usage=_usage(body.get("usage")),
        response_id=body.get("id"),
        model=body.get("model"),
    )


class StreamAssembler:
    """Rebuilds a Messages response from its SSE events."""

    def __init__(self, api: str = API):
        self.message: dict = {}
        self.blocks: dict[int, dict] = {}
        self.partial_json: dict[int, list[str]] = {}
        self.parts: dict[tuple[int, str], list[str]] = {}  # text, thinking, signature deltas per block
        self.usage: dict = {}
        self.stop_reason = None
        self.stopped = False
        self.error = None
        self.output_started = False
        self.notes: list[str] = []

    @property
    def terminal(self) -> bool:
        return self.stopped or self.error is not None

    def feed(self, event: str | None, data: str) -> None:
        self.feed_parsed(event, json.loads(data))

    def feed_parsed(self, event: str | None, payload: Any) -> None:
        """One event, already parsed (the writer parses a stream's events in one pass)."""
        if not isinstance(payload, dict):
            raise ProtocolError("stream event is not a JSON object")
        kind = payload.get("type") or event
        if kind not in KNOWN_EVENTS:
            self.notes.append(f"unknown stream event type {kind!r}")
            return
        if kind == "message_start":
            self.message = payload.get("message") or {}
            self.usage.update(self.message.get("usage") or {})
        elif kind == "content_block_start":
            index = payload.get("index", len(self.blocks))
            block = dict(payload.get("content_block") or {})
            for field in TEXT_FIELDS:
                self.parts.pop((index, field), None)
            if block.get("type") in ("tool_use", "server_tool_use"):
                self.partial_json[index] = []
            self.blocks[index] = block
            self.output_started = True
        elif kind == "content_block_delta":
            index = payload.get("index", 0)
            block = self.blocks.setdefault(index, {"type": "text", "text": ""})
            delta = payload.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "text_delta":
                self._append(index, block, "text", delta.get("text"))
            elif dtype == "input_json_delta":
                self.partial_json.setdefault(index, []).append(delta.get("partial_json") or "")
            elif dtype == "thinking_delta":
                self._append(index, block, "thinking", delta.get("thinking"))
            elif dtype == "signature_delta":
                self._append(index, block, "signature", delta.get("signature"))
            elif dtype == "citations_delta":
                block.setdefault("citations", []).append(delta.get("citation"))
            else:
                self.notes.append(f"unknown content delta type {dtype!r}")
            self.output_started = True
        elif kind == "content_block_stop":
            self._close_json(payload.get("index", 0))
        elif kind == "message_delta":
            delta = payload.get("delta") or {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            self.usage.update(payload.get("usage") or {})
        elif kind == "message_stop":
            self.stopped = True
        elif kind == "error":
            self.error = json.dumps(payload.get("error"))

    def _append(self, index: int, block: dict, field: str, text: str | None) -> None:
        """Deltas are joined once, at the end: adding each to the block's string is quadratic."""
        parts = self.parts.get((index, field))
        if parts is None:
            parts = self.parts[(index, field)] = [block.get(field) or ""]
        parts.append(text or "")

    def _close_json(self, index: int) -> None:
        parts = self.partial_json.pop(index, None)
        if parts is None:
            return
        text = "".join(parts)
        try:
            self.blocks[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            self.blocks[index]["input"] = {}
            self.notes.append(f"tool_use block {index} has unparseable input JSON: {text[:200]!r}")

    def finish(self) -> Completion:
        for (index, field), parts in self.parts.items():
            if index in self.blocks:
                self.blocks[index][field] = "".join(parts)
        self.parts.clear()
        for index in list(self.partial_json):
            self._close_json(index)
        blocks = [self.blocks[i] for i in sorted(self.blocks)]
        status, error = "ok", self.error
        if error:
            status = "error"
        elif self.notes:
            status, error = "error", "; ".join(self.notes)
        elif not self.stopped:
            status, error = "incomplete", "stream ended before message_stop"
        return Completion(
            message=assistant_from_blocks(blocks),
            wire=[{"role": "assistant", "content": blocks}],
            finish_reason=self.stop_reason,
            usage=_usage(self.usage) if self.usage else None,
            response_id=self.message.get("id"),
            model=self.message.get("model"),
            status=status,
            error=error,
            notes=list(self.notes),
        )


# With or without ?beta=true (the query is not matched).
PROTOCOL = Protocol(api=API, path=r"/v1/messages$", parse_request=parse_request, parse_response=parse_response,
                    StreamAssembler=StreamAssembler, via_chat=messages_via_chat)
