"""What a white-box run's engine door saw its engine answer: each choice's output token ids, the
weight versions that sampled them where the engine names them (vLLM's token route,
``/inference/v1/generate``: ``choices[i].weight_versions`` spans over the output tokens, in a
whole body or on a stream's final chunk; ``stepmill simulate-llm`` answers alike), and when the door
saw the request.

Read in the runner's door thread as the answer passes, kept per run, and looked up by the runner's
step reader with the output ids a step line reports (each answer backs one step): a step no answer
carried is not the engine's and is refused; one the engine answered gets the version the engine
gave those very tokens, or is stamped by when the door saw its request. A line's own version and
time fields are never read.

Only what versions need is kept (ids packed 8 bytes each, spans), within ``KEPT_BYTES`` per run:
past it the oldest answers go first, and a step reported after its answer went is refused like one
no answer carried (a run that holds back its steps that long loses them, never the runner's memory).
"""

from __future__ import annotations

import array
import json
import threading
import time
import zlib

MAX_ANSWER = 32 * 1024 * 1024  # bytes of one answer read at most; a longer one backs no step
KEPT_BYTES = 16 * 1024 * 1024  # what one run's kept answers may hold (2M output tokens at 8 bytes)
ENTRY_BYTES = 128  # what one kept answer costs beside its ids and spans


class Answer:
    """The bytes of one answer as they pass, up to ``MAX_ANSWER``, and when the door saw its request."""

    def __init__(self):
        self.asked_at = time.time()
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size <= MAX_ANSWER:
            self.parts.append(data)

    def raw(self) -> bytes | None:
        return b"".join(self.parts) if self.size <= MAX_ANSWER else None


class EngineAnswers:
    """One run's engine answers: packed output ids -> {"weight_versions": spans, "asked_at": time}.
    Written by the door thread, read by the step reader."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_ids: dict[bytes, dict] = {}
        self.size = 0  # bytes the kept answers count for, at most KEPT_BYTES

    @staticmethod
    def reading() -> Answer:
        return Answer()

    def keep(self, answer: Answer) -> None:
        raw = answer.raw()
        if raw is None:
            return
        for ids, spans in versions_in(raw):
            packed = _packed(ids)
            if packed is None:
                continue
            said = {"weight_versions": spans, "asked_at": answer.asked_at, "backs": 1,
                    "size": len(packed) + len(json.dumps(spans)) + ENTRY_BYTES}
            with self.lock:
                known = self.by_ids.pop(packed, None)
                if known is not None:  # the same ids answered again: one more step they back
                    said["backs"] += known["backs"]
                self.size += said["size"] - (known["size"] if known else 0)
                self.by_ids[packed] = said
                while self.size > KEPT_BYTES and self.by_ids:  # the oldest go first
                    self.size -= self.by_ids.pop(next(iter(self.by_ids)))["size"]

    def claim(self, response_ids) -> dict | None:
        """What the engine said of the answer with these output ids ({"weight_versions": spans,
        "asked_at": when the door saw the request}), or None: no kept answer carried them. An answer
        backs one step: claimed, it is gone (a line sent twice is one step)."""
        packed = _packed(response_ids) if isinstance(response_ids, list) else None
        if packed is None:
            return None
        with self.lock:
            said = self.by_ids.get(packed)
            if said is not None:
                said["backs"] -= 1
                if not said["backs"]:
                    self.size -= self.by_ids.pop(packed)["size"]
            return said


def _packed(ids) -> bytes | None:
    """Token ids as 8-byte integers: what is kept and looked up; None for what are no such ids."""
    try:
        return array.array("q", ids).tobytes()
    except (TypeError, OverflowError):
        return None


def versions_in(raw: bytes) -> list[tuple[list, list]]:
    """(output ids, weight version spans, [] where the engine named none) of each choice of an HTTP
    answer (status 200), whole or streamed (SSE); nothing where the answer cannot be read."""
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


def _streamed(body: bytes) -> list[tuple[list, list]]:
    events = []
    for line in body.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            events.append(json.loads(line[5:]))
    return _spans_of(events)


def _spans_of(payloads: list) -> list[tuple[list, list]]:
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
    return [(given, spans.get(index, [])) for index, given in ids.items()
            if all(isinstance(token, int) and not isinstance(token, bool) for token in given)]


def _dechunked(body: bytes) -> bytes:
    out, at = [], 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        at = end + 2 + size + 2
