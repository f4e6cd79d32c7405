"""Google's Gemini API (``…/models/{model}:generateContent`` and ``:streamGenerateContent``), as Gemini CLI
and the google-genai SDKs speak it: ``contents`` of ``user`` and ``model`` turns made of parts (``text``,
``thought`` text, ``functionCall``, ``functionResponse``, opaque ``thoughtSignature``s), a
``systemInstruction``, ``tools`` of ``functionDeclarations``, usage in ``usageMetadata``.

A streamed call comes in two forms: Server-Sent Events with ``?alt=sse`` (what the SDKs ask for), else one
JSON array whose elements arrive one by one. Every element is a whole ``GenerateContentResponse`` of the
parts since the last one: text parts are deltas to join, a function call comes whole. The stream has no
end marker: it is finished when a candidate says its ``finishReason``.

The REST API takes both JSON spellings of its fields (``systemInstruction`` and ``system_instruction``):
both are read. The model is named in the path, not the body (``model_from_path``).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from stepmill.protocols import gemini_via_chat
from stepmill.protocols.base import (AssistantBuilder, Completion, ParsedRequest, ProtocolError, canonical_content,
                                     load_json_object, tool_call, usage_of)
from stepmill.protocols.contract import Protocol
from stepmill.protocols.gemini_wire import PATH, _get, _parts, model_from_path, streamed_path, tools_of
from stepmill.protocols.sse import events_of

API = "gemini.generate"


def _usage(raw):
    return usage_of(raw, input_key="promptTokenCount", output_key="candidatesTokenCount",
                    cache_read=("cachedContentTokenCount",))


def _text(parts: list[dict]) -> str:
    return "".join(p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought"))


def _call_id(call: dict) -> Any:
    return call.get("id")


def assistant_from_parts(parts: list[dict]) -> dict:
    """A ``model`` turn as a canonical assistant message: thoughts as reasoning, function calls as tool
    calls (with the API's ``id`` where it gives one; Gemini's older models give none)."""
    builder = AssistantBuilder()
    for part in parts:
        call = _get(part, "functionCall")
        if isinstance(call, dict):
            builder.calls.append(tool_call(_call_id(call), call.get("name"), call.get("args") or {}))
        elif isinstance(part.get("text"), str):
            (builder.reasoning if part.get("thought") else builder.text).append(part["text"])
        # inlineData, executableCode, bare thoughtSignature parts: in the wire form only
    return builder.message()


def canonical_messages(system: Any, contents: list) -> list[dict]:
    out: list[dict] = []
    if system is not None:
        text = system if isinstance(system, str) else _text(_parts(system, "systemInstruction"))
        out.append({"role": "system", "content": text})
    for index, content in enumerate(contents):
        if not isinstance(content, dict):
            raise ProtocolError(f"contents[{index}] is not an object")
        parts = _parts(content, f"contents[{index}]")
        if content.get("role") == "model":
            out.append(assistant_from_parts(parts))
            continue
        rest = []
        for part in parts:
            answer = _get(part, "functionResponse")
            if isinstance(answer, dict):
                tool = {"role": "tool", "tool_call_id": answer.get("id"), "name": answer.get("name"),
                        "content": json.dumps(answer.get("response"), ensure_ascii=False, sort_keys=True)}
                out.append(tool)
            else:
                rest.append({"type": "text", "text": part["text"]} if isinstance(part.get("text"), str) else part)
        if rest:
            out.append({"role": "user", "content": canonical_content(rest)})
    return out


def parse_request(body: dict, api: str = API) -> ParsedRequest:
    contents = body.get("contents")
    if not isinstance(contents, list):
        raise ProtocolError("generateContent request has no 'contents' list")
    params = {k: v for k, v in body.items() if k not in ("contents", "tools")}
    session = (body.get("labels") or {}).get("session_id") if isinstance(body.get("labels"), dict) else None
    return ParsedRequest(
        api=api,
        model=body.get("model"),  # usually in the path: the ingest fills it in from there
        stream=False,  # the path says it: from_path
        params=params,
        tools=tools_of(body),
        messages=canonical_messages(_get(body, "systemInstruction"), contents),
        wire_messages=contents,
        session_id=session,
    )


def from_path(request: ParsedRequest, path: str) -> None:
    """What the path says of a parsed request: its model, and whether it streams."""
    request.model = request.model or model_from_path(path)
    request.stream = streamed_path(path)


def _error(body: dict) -> Completion | None:
    if "error" in body and not body.get("candidates"):
        return Completion(status="error", error=json.dumps(body["error"]), response_id=_get(body, "responseId"))
    return None


def parse_response(body: dict | list, api: str = API) -> Completion:
    """A whole response, or the elements of a streamed JSON array (``load_response``), fed in order."""
    if isinstance(body, list):
        assembler = StreamAssembler(api)
        for element in body:
            failed = _error(element)
            if failed:
                return failed
            assembler.feed_parsed(None, element)
        return assembler.finish()
    failed = _error(body)
    if failed:
        return failed
    assembler = StreamAssembler(api)
    assembler.feed_parsed(None, body)
    completion = assembler.finish()
    if not assembler.finished and completion.status == "incomplete":
        # a whole answer without a candidate's finishReason: a blocked prompt says why in promptFeedback
        feedback = _get(body, "promptFeedback")
        completion.status, completion.error = ("error", f"no candidate: {json.dumps(feedback)}") if feedback \
            else ("ok", None)
    return completion


def load_response(body: bytes, what: str):
    """A whole response: one object, or (``:streamGenerateContent`` without ``alt=sse``) an array of them."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None
    if isinstance(value, list):
        if not all(isinstance(v, dict) for v in value):
            raise ProtocolError(f"{what} is a JSON array of something else than objects")
        return value
    return load_json_object(body, what)


def json_array_events(raw: bytes) -> Iterator[tuple[int, None, str]]:
    """The elements of a streamed JSON array as they are complete: (end offset, None, element's JSON).
    Brackets inside strings are skipped; what a cut stream leaves half-written is not yielded."""
    depth, in_string, escaped, start = 0, False, False, None
    for offset, byte in enumerate(raw):
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
            continue
        if byte == 0x22:
            in_string = True
        elif byte == 0x7B:  # {
            if depth == 0:
                start = offset
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0 and start is not None:
                yield offset + 1, None, raw[start:offset + 1].decode("utf-8", "replace")
                start = None


def split_stream(raw: bytes) -> Iterator[tuple[int, str | None, str]]:
    """A stream's events, whichever of its two forms it came in."""
    head = raw.lstrip()[:1]
    return json_array_events(raw) if head == b"[" else events_of(raw)


class StreamAssembler:
    """Rebuilds a response from its chunks (SSE events or a JSON array's elements): text and thought
    deltas joined, function calls kept whole and in order, the last usage, the candidate's
    finishReason as the end."""

    def __init__(self, api: str = API):
        self.parts: list[dict] = []  # wire parts, adjacent text deltas of one kind merged
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.response_id = None
        self.model = None
        self.error: str | None = None
        self.notes: list[str] = []
        self.output_started = False
        self.finished = False

    @property
    def terminal(self) -> bool:
        return self.finished or self.error is not None

    def feed(self, event: str | None, data: str) -> None:
        self.feed_parsed(event, json.loads(data))

    def feed_parsed(self, event: str | None, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise ProtocolError("stream chunk is not a JSON object")
        if "error" in chunk and not chunk.get("candidates"):
            self.error = json.dumps(chunk["error"])
            return
        self.response_id = _get(chunk, "responseId") or self.response_id
        self.model = _get(chunk, "modelVersion") or self.model
        if isinstance(_get(chunk, "usageMetadata"), dict):
            self.usage = _get(chunk, "usageMetadata")
        candidates = chunk.get("candidates") or []
        if not isinstance(candidates, list):
            raise ProtocolError("'candidates' is not a list")
        for candidate in candidates:
            if not isinstance(candidate, dict) or candidate.get("index", 0) != 0:
                continue  # candidateCount > 1: the first is the step (Gemini CLI asks for one)
            content = candidate.get("content")
            for part in _parts(content, "candidate content") if isinstance(content, dict) else []:
                self._add(part)
            reason = _get(candidate, "finishReason")
            if reason:
                self.finish_reason, self.finished = reason, True

    def _add(self, part: dict) -> None:
        self.output_started = True
        last = self.parts[-1] if self.parts else None
        text = part.get("text")
        mergeable = isinstance(text, str) and set(part) <= {"text", "thought", "thoughtSignature", "thought_signature"}
        if mergeable and last is not None and isinstance(last.get("text"), str) \
                and bool(last.get("thought")) == bool(part.get("thought")) \
                and set(last) <= {"text", "thought", "thoughtSignature", "thought_signature"}:
            merged = {**last, "text": last["text"] + text}
            for key in ("thoughtSignature", "thought_signature"):
                if key in part:
                    merged[key] = part[key]
            self.parts[-1] = merged
        else:
            self.parts.append(dict(part))

    def finish(self) -> Completion:
        status, error = "ok", self.error
        if error:
            status = "error"
        elif self.notes:
            status, error = "error", "; ".join(self.notes)
        elif not self.finished:
            status, error = "incomplete", "stream ended before a candidate's finishReason"
        return Completion(
            message=assistant_from_parts(self.parts),
            wire=[{"role": "model", "parts": list(self.parts)}],
            finish_reason=self.finish_reason,
            usage=_usage(self.usage),
            response_id=self.response_id,
            model=self.model,
            status=status,
            error=error,
            notes=list(self.notes),
        )


PROTOCOL = Protocol(api=API, path=PATH, parse_request=parse_request, parse_response=parse_response,
                    StreamAssembler=StreamAssembler, load_response=load_response, from_path=from_path,
                    split=split_stream, streamed_path=streamed_path, via_chat=gemini_via_chat)
