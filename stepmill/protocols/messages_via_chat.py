"""Anthropic Messages served through an engine's chat completions, for exact token ids.

vLLM's and SGLang's ``/v1/messages`` have no token-id fields, but their chat completions do
(``return_token_ids``). For an engine host the proxy may therefore send an agent's Messages call
(Claude Code on a self-hosted model) to the engine's ``/chat/completions`` and translate the
answer back — whole, or streamed event by event (thinking, text, tool_use, usage, stop reasons) —
so the agent sees a faithful Messages exchange while the step holds what the engine sampled.

On the event loop: the request is translated once before it moves; a stream is translated per
event as it arrives (``StreamTranslator``, plugged into the stream tap). Pure functions otherwise.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from stepmill.protocols.contract import Translated
from stepmill.protocols.openai_chat import reasoning_of
from stepmill.protocols.via_chat import ChatStreamTranslator, Malformed, error_message, not_carried, tool_arguments

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "abort": "end_turn"}


ENGINE_ENDPOINT = True  # vLLM and SGLang serve /v1/messages themselves (without ids)
NOTE = ("an Anthropic Messages call, served through the engine's chat completions for exact token ids; the agent "
        "got the answer as Messages")


class Untranslatable(ValueError):
    """A Messages request the chat protocol cannot carry: it goes to the engine's /v1/messages as is."""


def chat_path(path: str) -> str:
    """The engine's chat completions beside its Messages endpoint: ``/x/v1/messages`` → ``/x/v1/chat/completions``."""
    return path.split("?", 1)[0].rstrip("/").removesuffix("/messages") + "/chat/completions"


# What request_to_chat reads; ``metadata`` (the caller's user id) asks nothing of the model.
BODY_READ = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "tools",
             "tool_choice", "stream", "metadata"}


def translate(body: dict, path: str, engine: str = "vllm") -> Translated:
    """The call for the engine's chat completions, what the answer's translation back needs, and what the
    chat request could not carry (extended thinking, a service tier, MCP servers, ...)."""
    notes: list[str] = []
    not_carried(notes, "", sorted(k for k in body if k not in BODY_READ))
    return Translated(request_to_chat(body, engine), chat_path(path),
                      {"model": body.get("model"), "stop_sequences": body.get("stop_sequences")}, notes)


# -- request --------------------------------------------------------------------------------------
def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _user_parts(blocks: list) -> list:
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image" and isinstance(block.get("source"), dict):
            source = block["source"]
            if source.get("type") == "base64":
                url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
            elif source.get("type") == "url":
                url = source.get("url", "")
            else:
                raise Untranslatable(f"image source {source.get('type')!r}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind not in ("tool_result",):
            raise Untranslatable(f"content block {kind!r} in a user message")
    return parts


def messages_of(body: dict) -> list[dict]:
    """The conversation as chat messages: system first, a tool result as a ``tool`` message."""
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system)})
    if not isinstance(body.get("messages") or [], list):
        raise Malformed("'messages' is not a list")
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            raise Malformed("a message is not an object")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise Malformed(f"the content of a {role} message is neither a string nor a list of blocks")
        blocks = [b for b in content if isinstance(b, dict)]
        if role == "assistant":
            text, thinking, calls = [], [], []
            for block in blocks:
                kind = block.get("type")
                if kind == "text":
                    text.append(block.get("text", ""))
                elif kind == "thinking":
                    thinking.append(block.get("thinking", ""))
                elif kind == "redacted_thinking":
                    continue
                elif kind == "tool_use":
                    calls.append({"id": block.get("id"), "type": "function", "function": {
                        "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
                else:
                    raise Untranslatable(f"content block {kind!r} in an assistant message")
            message_out: dict = {"role": "assistant", "content": "".join(text)}
            if thinking:
                message_out["reasoning_content"] = "".join(thinking)
            if calls:
                message_out["tool_calls"] = calls
            out.append(message_out)
        else:
            for block in blocks:  # results answer the calls before them, ahead of any new text
                if block.get("type") == "tool_result":
                    result = block.get("content")
                    if isinstance(result, list) and any(isinstance(b, dict) and b.get("type") != "text"
                                                        for b in result):
                        raise Untranslatable("a tool result with images or documents")  # chat tool messages hold text
                    text = _text(result) if not isinstance(result, str) else result
                    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": ("Error: " if block.get("is_error") else "") + text})
            parts = _user_parts(blocks)
            if parts:
                simple = all(p["type"] == "text" for p in parts)
                out.append({"role": "user", "content": "".join(p["text"] for p in parts) if simple else parts})
    return out


def request_to_chat(body: dict, engine: str = "vllm") -> dict:
    """A Messages request as the chat request that asks the engine for the same sample, with ids
    (SGLang refuses ``return_token_ids`` on streamed chat: its ``sglext`` flags instead)."""
    chat: dict = {"model": body.get("model"), "messages": messages_of(body), "logprobs": True}
    if engine == "sglang":
        chat["return_input_ids_in_sglext"] = chat["return_output_ids_in_sglext"] = True
    else:
        chat["return_token_ids"] = True
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    if tools:
        if any(t.get("type") not in (None, "custom") and "input_schema" not in t for t in tools):
            raise Untranslatable("server tools (web search, code execution) have no chat form")
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description", ""),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or (
            {"type": "function", "function": {"name": choice.get("name")}} if kind == "tool" else "auto")
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


# -- a whole answer ------------------------------------------------------------------------------------
def message_id(chat_id: Any) -> str:
    return "msg_" + (str(chat_id).replace("chatcmpl-", "") if chat_id else uuid.uuid4().hex)


def _stop(choice: dict, stop_sequences: list) -> tuple[str, str | None]:
    reason = choice.get("finish_reason")
    matched = choice.get("stop_reason")  # vLLM: the stop string that ended it, if one did
    if reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return STOP_REASONS.get(reason, "end_turn"), None


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    return {"input_tokens": usage.get("prompt_tokens") or 0, "output_tokens": usage.get("completion_tokens") or 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def chat_to_message(payload: dict, *, model: str | None, stop_sequences: list | None = None) -> dict:
    """The engine's chat answer as the Messages answer the agent expects (ids and logprobs dropped)."""
    if "choices" not in payload:
        return error_body(payload)
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                        "name": function.get("name"), "input": tool_arguments(function.get("arguments"))})
    stop_reason, stop_sequence = _stop(choice, stop_sequences or [])
    return {"id": message_id(payload.get("id")), "type": "message", "role": "assistant", "model": model or payload.get("model"),
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(payload.get("usage"))}


answer_of = chat_to_message  # what the proxy calls on a whole answer, whichever protocol it translates to


# Anthropic's error types for the HTTP statuses an engine answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_body(payload: Any, status: int | None = None) -> dict:
    """An engine's error in Messages' shape, its type the HTTP status's (an error chunk of a stream has no
    status: an ``error`` object is the request's fault, anything else the API's)."""
    message, is_error = error_message(payload)
    if status is None:
        kind = "invalid_request_error" if is_error else "api_error"
    else:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# -- a stream, event by event -----------------------------------------------------------------------------
def sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass") + b"\n\n"


class StreamTranslator(ChatStreamTranslator):
    """Chat completion chunks in, Messages events out: one content block open at a time (thinking,
    text, or one tool_use per call index), closed when another starts and at the end."""

    def __init__(self, *, model: str | None, stop_sequences: list | None = None):
        self.model = model
        self.stop_sequences = stop_sequences or []
        self.started = False
        self.block: tuple | None = None  # ("thinking" | "text" | "tool", call index) of the open block
        self.index = -1
        self.finish: dict | None = None  # the choice that carried finish_reason
        self.usage: dict | None = None

    def on_error(self, chunk: dict) -> bytes:
        return sse("error", error_body(chunk))

    def on_chunk(self, chunk: dict) -> bytes:
        out = [self._start(chunk)] if not self.started else []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                out.append(self._open(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""}))
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                out.append(self._open(("text", None), {"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                key = ("tool", call.get("index", 0))
                if self.block != key:
                    out.append(self._open(key, {"type": "tool_use", "id": call.get("id") or
                                                f"toolu_{uuid.uuid4().hex[:24]}", "name": function.get("name"),
                                                "input": {}}))
                if function.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.finish = choice
        return b"".join(out)

    def close(self) -> bytes:
        """The end of the stream (``[DONE]``, or the body ended without it)."""
        if self.done:
            return b""
        self.done = True
        out = [] if self.started else [self._start({})]
        out.append(self._close_block())
        if not self.finished and self.finish is None:  # cut short: the agent must not take it as a whole answer
            out.append(sse("error", {"type": "error", "error": {
                "type": "api_error", "message": "the engine's stream ended before its last chunk"}}))
            return b"".join(out)
        stop_reason, stop_sequence = _stop(self.finish or {"finish_reason": "stop"}, self.stop_sequences)
        usage = _usage(self.usage)
        out.append(sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": {
            "output_tokens": usage["output_tokens"]}}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def _start(self, chunk: dict) -> bytes:
        self.started = True
        usage = _usage(chunk.get("usage"))
        usage["output_tokens"] = 1 if usage["output_tokens"] == 0 else usage["output_tokens"]
        return sse("message_start", {"type": "message_start", "message": {
            "id": message_id(chunk.get("id")), "type": "message", "role": "assistant",
            "model": self.model or chunk.get("model"), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage}})

    def _open(self, key: tuple, block: dict) -> bytes:
        if self.block == key:
            return b""
        closing = self._close_block()
        self.index += 1
        self.block = key
        return closing + sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close_block(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
