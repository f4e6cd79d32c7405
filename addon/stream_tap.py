"""The callable mitmproxy calls with each chunk of a streamed response, and the reassembly of
what it kept.

It passes bytes on as they arrive (the agent sees the first event before the upstream sends
the last) and, when the engine was asked for extra fields, rewrites whole events to take them
out again. The copy it keeps is reassembled later, off the event loop, by ``assemble``.

mitmproxy sends whatever the callable returns; an empty ``bytes`` at the wrong moment ends an
HTTP/1 body early. So the tap always returns a *list* of chunks: empty while a rewritten event
is still partial, never an empty chunk.
"""

from __future__ import annotations

import bisect
import json
import time
import zlib
from dataclasses import dataclass
from typing import Callable

from stepmill.protocols.sse import Event, SSEDecoder, events_of


def decompressor(encoding: str | None) -> Callable[[bytes], bytes] | None:
    """A streaming decoder for a Content-Encoding; None for identity. ValueError if unknown."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(47).decompress  # 32 + 15: gzip or zlib header, detected
    if encoding == "deflate":
        return _Deflate().decompress
    if encoding == "br":
        import brotli  # a mitmproxy dependency

        return brotli.Decompressor().process
    if encoding == "zstd":
        return _ZstdFrames().decompress
    raise ValueError(f"unsupported content-encoding {encoding!r}")


class _Deflate:
    """``deflate`` is zlib-wrapped by the standard, raw in some servers: told apart by the first bytes."""

    def __init__(self):
        self.current = None
        self.head = b""

    def decompress(self, data: bytes) -> bytes:
        if self.current is None:
            self.head += data
            if len(self.head) < 2:
                return b""
            zlib_header = self.head[0] & 0x0F == 8 and (self.head[0] << 8 | self.head[1]) % 31 == 0
            self.current = zlib.decompressobj(47 if zlib_header or self.head[:2] == b"\x1f\x8b" else -15)
            data, self.head = self.head, b""
        return self.current.decompress(data)


DECODE_SLICE = 1 << 16  # compressed bytes decoded at a time: a small input cannot expand unbounded past a limit


def decode_kept(raw: bytes, content_encoding: str | None, marks: list | None = None,
                limit: int | None = None) -> tuple[bytes, list, str | None, bool]:
    """Off the loop: a kept body decoded, chunk by chunk as it arrived (``marks``: (end offset, time) per
    chunk; their offsets become the decoded ones). Returns (data, marks, problem, cut): on a problem, only
    what decoded before it (undecoded bytes cannot be redacted, so they are never kept); ``cut`` when the
    decoded body passed ``limit`` and was cut there."""
    try:
        decompress = decompressor(content_encoding)
    except ValueError as exc:
        return b"", [], f"body could not be decoded: {exc}", False
    if decompress is None:
        return raw, list(marks or []), None, False
    out, kept_marks, start = bytearray(), [], 0
    try:
        for end, at in (list(marks) if marks else [(len(raw), None)]):
            for piece in range(start, end, DECODE_SLICE):
                out += decompress(raw[piece:min(end, piece + DECODE_SLICE)])
                if limit and len(out) > limit:
                    del out[limit:]
                    kept_marks.append((limit, at))
                    return bytes(out), kept_marks, None, True
            kept_marks.append((len(out), at))
            start = end
        if start < len(raw):
            out += decompress(raw[start:])
    except Exception as exc:
        return bytes(out[:limit] if limit else out), kept_marks, \
            f"body could not be decoded ({content_encoding}): {exc}", False
    return bytes(out), kept_marks, None, False


class _ZstdFrames:
    """Streaming zstd decoding across frame boundaries (mitmproxy ships backports.zstd before 3.14)."""

    def __init__(self):
        try:
            from compression import zstd
        except ImportError:
            from backports import zstd
        self.zstd = zstd
        self.current = zstd.ZstdDecompressor()

    def decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self.current.decompress(data))
            if not self.current.eof:
                break
            data = self.current.unused_data
            self.current = self.zstd.ZstdDecompressor()
        return b"".join(out)


class StreamTap:
    """On the event loop: pass chunks on and keep the upstream's bytes, with when each arrived.

    Passing through (the usual case) costs an append per chunk; nothing is parsed. Only when
    ``rewrite`` is set (engine fields to take out) are events decoded, and only those whose data
    contains one of ``markers`` are parsed and re-serialised. Reassembling the completion is the
    writer's job (``assemble``), off the loop.
    """

    def __init__(self, *, rewrite: Callable[[dict], bool] | None = None, markers: tuple[str, ...] = (),
                 content_encoding: str | None = None, limit: int | None = None,
                 translate: Callable[[Event], bytes] | None = None, translate_end: Callable[[], bytes] | None = None):
        """``translate``: every event becomes what it returns (another protocol's events, see
        messages_via_chat.py), and ``translate_end()`` is sent when the stream ends."""
        self.rewrite = rewrite
        self.translate = translate
        self.translate_end = translate_end
        self.markers = markers
        self.content_encoding = content_encoding
        self.decoder = SSEDecoder()
        self.raw = bytearray()  # what is kept for the step: at most ``limit`` bytes; the agent gets every byte
        self.limit = limit or None
        self.received = 0
        self.marks: list[tuple[int, float]] = []  # (bytes received so far, time) per chunk
        self.notes: list[str] = []
        self.ended = False
        self.decompress = None
        if rewrite is not None or translate is not None:
            try:
                self.decompress = decompressor(content_encoding)
            except ValueError as exc:
                self.notes.append(f"{exc}; engine fields were left in the stream")
                self.rewrite = None  # undecodable bytes are passed on as they are, with their encoding
        self.decoding = True

    @property
    def rewriting(self) -> bool:
        """True when the agent gets the tap's (decoded) events instead of the upstream's bytes."""
        return self.rewrite is not None or self.translate is not None

    def __call__(self, chunk: bytes) -> list[bytes]:
        if chunk:
            self.received += len(chunk)
            if self.limit is None or len(self.raw) < self.limit:  # past it, memory stays flat however long
                self.raw += chunk if self.limit is None else chunk[:self.limit - len(self.raw)]
                self.marks.append((len(self.raw), time.time()))
        else:
            self.ended = True
        if not self.rewriting:
            return [chunk] if chunk else []
        if not self.decoding:
            return []  # the upstream's compressed bytes are broken: nothing plain can follow
        try:
            data = self.decompress(chunk) if (self.decompress and chunk) else chunk
        except Exception as exc:
            self.notes.append(f"stream could not be decompressed: {exc}")
            self.decoding = False
            return []
        events = self.decoder.push(data) if chunk else self.decoder.flush()
        if self.translate is not None:
            try:
                out = b"".join(self.translate(event) for event in events)
                if not chunk and self.translate_end is not None:
                    out += self.translate_end()
            except Exception as exc:  # noted; the agent gets what translated so far, never a traceback
                self.notes.append(f"could not translate a stream event: {exc}")
                out = b""
        else:
            out = b"".join(self._rewrite(event) for event in events)
        return [out] if out else []

    def _rewrite(self, event: Event) -> bytes:
        """The bytes the agent gets for one event."""
        if not event.data or not any(m in event.data for m in self.markers):
            return event.raw
        try:
            payload = json.loads(event.data)
            if not isinstance(payload, dict) or not self.rewrite(payload):
                return event.raw
            if not payload:
                return b""  # an event that only carried what the agent did not ask for
            body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        except Exception as exc:  # the agent gets the event as it came rather than a broken one
            self.notes.append(f"could not rewrite a stream event: {exc}")
            return event.raw
        prefix = f"event: {event.event}\n".encode() if event.event else b""
        return prefix + b"data: " + body + b"\n\n"


@dataclass
class Assembled:
    completion: object  # protocols.Completion
    first_output_at: float | None
    terminal: bool


def assemble(assembler, raw: bytes, marks: list, content_encoding: str | None) -> Assembled:
    """Off the loop: rebuild the completion from the upstream's bytes, chunk by chunk as they came,
    so the time of the first output event is known. Never raises."""
    data, marks, problem, _ = decode_kept(bytes(raw), content_encoding, marks)
    bounds = list(marks) if marks else ([(len(data), None)] if data else [])
    return _assemble_plain(assembler, data, bounds, [problem] if problem else [])


def _assemble_plain(assembler, raw: bytes, bounds: list, notes: list[str]) -> Assembled:
    """A decoded stream, split at once; the first output event's time is that of the chunk it
    arrived in (the first mark at or past its end)."""
    first_output_at = None
    ends = [end for end, _ in bounds]
    try:
        for end, name, data in events_of(raw):
            _feed(assembler, Event(name, data, b""), notes)
            if first_output_at is None and assembler.output_started and ends:
                first_output_at = bounds[min(bisect.bisect_left(ends, end), len(bounds) - 1)][1]
    except Exception as exc:
        notes.append(f"stream decoding failed: {exc}")
    return _finished(assembler, notes, first_output_at)


def _finished(assembler, notes: list[str], first_output_at) -> Assembled:
    try:
        completion = assembler.finish()
    except Exception as exc:
        from stepmill.protocols import Completion

        completion = Completion(status="error", error=f"stream could not be reassembled: {exc}")
    if notes:
        completion.notes = list(completion.notes) + notes
        if completion.status == "ok":
            completion.status, completion.error = "error", "; ".join(notes)
    return Assembled(completion, first_output_at, bool(getattr(assembler, "terminal", False)))


_scan = json.JSONDecoder().scan_once  # the C scanner itself: json.loads adds three Python calls per event
_UNPARSED = object()


def _parsed(data: str):
    """The JSON value of an event's data, or _UNPARSED (then the assembler parses it, and says why not)."""
    try:
        value, end = _scan(data, 0)
    except (StopIteration, ValueError):
        return _UNPARSED
    return value if end == len(data) or not data[end:].strip() else _UNPARSED


def _feed(assembler, event: Event, notes: list[str]) -> None:
    if not event.data:
        return
    try:
        value = _parsed(event.data)
        if value is _UNPARSED:
            assembler.feed(event.event, event.data)
        else:
            assembler.feed_parsed(event.event, value)
    except Exception as exc:
        notes.append(f"unparsed stream event {event.data[:200]!r}: {exc}")
