"""SGLang's native ``/generate``: token ids in (``input_ids``), token ids out.

With ``return_logprob`` the answer's ``meta_info.output_token_logprobs`` holds one
``[logprob, token_id, text-or-null]`` per sampled token: the exact response ids and their logprobs.
The prompt's ids are exact when the request sent ``input_ids`` (a text prompt leaves them to
``stepmill tokenize``). Streamed, each ``data:`` event carries the text and meta_info so far
(cumulative, or only what is new with ``incremental_streaming_output``), then ``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from stepmill.protocols.base import Completion, DoneTerminatedStream, ParsedRequest, ProtocolError, usage_of
from stepmill.protocols.contract import Protocol

API = "sglang.generate"


def parse_request(body: dict, api: str = API) -> ParsedRequest:
    if "text" not in body and "input_ids" not in body:
        raise ProtocolError("generate request has neither 'text' nor 'input_ids'")
    ids = body.get("input_ids")
    if ids is not None and not isinstance(ids, list):
        raise ProtocolError(f"'input_ids' must be a list of token ids, not {type(ids).__name__}")
    if isinstance(body.get("text"), list) or (ids and isinstance(ids[0], list)):
        raise ProtocolError("batched generate requests are not recorded (one prompt per call)")
    params = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
    prompt = body.get("text")
    return ParsedRequest(api=api, model=body.get("model"), stream=bool(body.get("stream")), params=params,
                         messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else [],
                         prompt_ids=prompt_ids(body))


def prompt_ids(body: dict | None) -> list[int] | None:
    ids = (body or {}).get("input_ids")
    return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def _pairs(entries: Any) -> tuple[list[int] | None, list[float] | None]:
    if not isinstance(entries, list):
        return None, None
    ids, logprobs = [], []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) >= 2 and isinstance(entry[1], int)):
            return None, None
        ids.append(entry[1])
        logprobs.append(entry[0])
    return ids, logprobs


def _finish(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def _completion(text: str, meta: dict, ids: list | None, logprobs: list | None) -> Completion:
    return Completion(
        message={"role": "assistant", "content": text},
        wire=[{"text": text}],
        finish_reason=_finish(meta),
        usage=usage_of(meta, input_key="prompt_tokens", output_key="completion_tokens"),
        response_id=meta.get("id"),
        response_ids=ids,
        logprobs=logprobs if logprobs and all(isinstance(v, (int, float)) for v in logprobs) else None,
    )


def parse_response(body: dict, api: str = API) -> Completion:
    if "error" in body and "text" not in body:
        return Completion(status="error", error=json.dumps(body["error"]))
    if not isinstance(body.get("text"), str):
        raise ProtocolError("generate response has no 'text'")
    meta = body.get("meta_info") if isinstance(body.get("meta_info"), dict) else {}
    ids, logprobs = _pairs(meta.get("output_token_logprobs"))
    if ids is None and isinstance(body.get("output_ids"), list):
        ids = body["output_ids"]
    return _completion(body["text"], meta, ids, logprobs)


class StreamAssembler(DoneTerminatedStream):
    def __init__(self, api: str = API):
        self.text = ""
        self.meta: dict = {}
        self.entries: list = []
        self.done = False
        self.error = None
        self.output_started = False
        self.notes: list[str] = []

    def feed_parsed(self, event: str | None, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise ProtocolError("stream chunk is not a JSON object")
        if "error" in chunk and "text" not in chunk:
            self.error = json.dumps(chunk["error"])
            return
        text = chunk.get("text") or ""
        meta = chunk.get("meta_info") if isinstance(chunk.get("meta_info"), dict) else {}
        entries = meta.get("output_token_logprobs")
        # Cumulative (the default) or incremental (incremental_streaming_output): the token count says
        # which — a cumulative event holds as many entries as tokens sampled so far.
        if entries:
            cumulative = isinstance(entries, list) and meta.get("completion_tokens") == len(entries)
        else:
            cumulative = text.startswith(self.text)
        self.text = text if cumulative else self.text + text
        self.output_started = self.output_started or bool(text)
        if isinstance(entries, list):
            self.entries = list(entries) if cumulative else self.entries + list(entries)
        self.meta = {**self.meta, **meta}

    def finish(self) -> Completion:
        ids, logprobs = _pairs(self.entries) if self.entries else (None, None)
        completion = _completion(self.text, self.meta, ids, logprobs)
        if self.error:
            completion.status, completion.error = "error", self.error
        elif not (self.done or _finish(self.meta)):
            completion.status, completion.error = "incomplete", "stream ended before [DONE]"
        completion.notes = list(self.notes)
        return completion


# SGLang's native endpoint, at the server's root (Ollama's /api/generate and the like are no match); recorded
# only on hosts the probe (or the setting) says are SGLang.
PROTOCOL = Protocol(api=API, path=r"^/generate$", parse_request=parse_request, parse_response=parse_response,
                    StreamAssembler=StreamAssembler, engine_ids="generate", engine_native="sglang")
