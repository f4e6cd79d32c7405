"""What a white-box run's engine door saw its engine answer: each choice's output token ids and the
weight versions that sampled them, as the engine sends them (vLLM's token route,
``/inference/v1/generate``: ``choices[i].weight_versions`` spans over the output tokens, in a
whole body or on a stream's final chunk; ``stepmill simulate-llm`` answers alike).

Read in the runner's door thread as the answer passes, kept per run, and looked up by the runner's
step reader with the output ids a step line reports: a step gets the version the engine gave
those very tokens, or none (it is then stamped by when it began). A line's own version fields are
never read.
"""

from __future__ import annotations

import json
import threading
import zlib

MAX_ANSWER = 32 * 1024 * 1024  # bytes of one answer read at most; a longer one gives no version
KEPT = 4096  # answers kept per run (the oldest go first): far more than a run's unreported calls


class Answer:
    """The bytes of one answer as they pass, up to ``MAX_ANSWER``."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size <= MAX_ANSWER:
            self.parts.append(data)

    def raw(self) -> bytes | None:
        return b"".join(self.parts) if self.size <= MAX_ANSWER else None


class EngineAnswers:
    """One run's engine answers: output ids -> {"weight_versions": spans}. Written by the door thread,
    read by the step reader."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_ids: dict[tuple, dict] = {}

    @staticmethod
    def reading() -> Answer:
        return Answer()

    def keep(self, answer: Answer) -> None:
        raw = answer.raw()
        if raw is None:
            return
        for ids, spans in versions_in(raw):
            with self.lock:
                self.by_ids[ids] = {"weight_versions": spans}
                while len(self.by_ids) > KEPT:
                    del self.by_ids[next(iter(self.by_ids))]

    def said(self, response_ids) -> dict:
        """What the engine said of the answer with these output ids: {"weight_versions": spans}, or {}."""
        if not isinstance(response_ids, list):
            return {}
        try:
            ids = tuple(response_ids)
            with self.lock:
                return self.by_ids.get(ids, {})
        except TypeError:  # ids that are no ids (a dict in the list) match nothing
            return {}


def versions_in(raw: bytes) -> list[tuple[tuple, list]]:
    """(output ids, weight version spans) of each choice of an HTTP answer (status 200), whole or
    streamed (SSE); nothing where the engine named no versions or the answer cannot be read."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if len(lines[0].split(" ")) < 2 or lines[0].split(" ")[1] != "200":
        return []
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = _dechunked(body)
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            body = zlib.decompressobj(wbits=47).decompress(body, MAX_ANSWER)
        elif encoding not in ("", "identity"):
            return []
        if "text/event-stream" in headers.get("content-type", ""):
            return _streamed(body)
        return _spans_of([json.loads(body)])
    except (ValueError, TypeError, AttributeError, zlib.error, RecursionError):
        return []


def _streamed(body: bytes) -> list[tuple[tuple, list]]:
    events = []
    for line in body.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            events.append(json.loads(line[5:]))
    return _spans_of(events)


def _spans_of(payloads: list) -> list[tuple[tuple, list]]:
    """Each choice's ids (joined across a stream's chunks) and its spans (on whichever chunk has them)."""
    ids: dict[int, list] = {}
    spans: dict[int, list] = {}
    for payload in payloads:
        for number, choice in enumerate(payload.get("choices") or [] if isinstance(payload, dict) else []):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", number)
            if isinstance(choice.get("token_ids"), list):
                ids.setdefault(index, []).extend(choice["token_ids"])
            if isinstance(choice.get("weight_versions"), list):
                spans[index] = [span for span in choice["weight_versions"]
                                if isinstance(span, dict) and {"version", "start", "end"} <= span.keys()]
    found = []
    for index, given in spans.items():
        if given and index in ids and all(isinstance(token, int) for token in ids[index]):
            found.append((tuple(ids[index]), given))
    return found


def _dechunked(body: bytes) -> bytes:
    out, at = [], 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        at = end + 2 + size + 2
