"""Off the event loop: a kept body decoded, and a kept event stream reassembled into a completion.

The pipeline's handoff thread decodes bodies (``decode_kept``) before it redacts them, and its writer
reassembles streams (``assemble``). ``decompressor`` is also what the event loop's stream tap uses to
decode a stream it rewrites. Wire formats only: nothing here knows the proxy, the pipeline or the store.
"""

from __future__ import annotations

import bisect
import json
import zlib
from dataclasses import dataclass
from typing import Callable

from stepmill.protocols.base import Completion
from stepmill.protocols.sse import Event, events_of


def decompressor(encoding: str | None, limit: int | None = None) -> Callable[[bytes], bytes] | None:
    """A streaming decoder for a Content-Encoding; None for identity. ValueError if unknown.

    With ``limit`` it makes at most about ``limit + 1`` bytes in all, however small its input (a brotli bomb
    of a few hundred bytes stands for terabytes): a caller that has more than ``limit`` knows the body decodes
    past it, and nothing past that is ever made."""
    backend = _backend((encoding or "").strip().lower())
    if backend is None or limit is None:
        return backend
    made = 0

    def bounded(data: bytes) -> bytes:
        nonlocal made
        if made > limit:
            return b""
        out = backend(data, limit + 1 - made)
        made += len(out)
        return out

    return bounded


def _backend(encoding: str) -> Callable[..., bytes] | None:
    """``decompress(data, max_length=None)``: at most ``max_length`` bytes of output when it is given."""
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        gzip = zlib.decompressobj(47)  # 32 + 15: gzip or zlib header, detected
        return lambda data, max_length=None: gzip.decompress(data, max_length or 0)
    if encoding == "deflate":
        return _Deflate().decompress
    if encoding == "br":
        import brotli  # a mitmproxy dependency

        br = brotli.Decompressor()
        return lambda data, max_length=None: br.process(data) if max_length is None else \
            br.process(data, output_buffer_limit=max_length)
    if encoding == "zstd":
        return _ZstdFrames().decompress
    raise ValueError(f"unsupported content-encoding {encoding!r}")


class _Deflate:
    """``deflate`` is zlib-wrapped by the standard, raw in some servers: told apart by the first bytes."""

    def __init__(self):
        self.current = None
        self.head = b""

    def decompress(self, data: bytes, max_length: int | None = None) -> bytes:
        if self.current is None:
            self.head += data
            if len(self.head) < 2:
                return b""
            zlib_header = self.head[0] & 0x0F == 8 and (self.head[0] << 8 | self.head[1]) % 31 == 0
            self.current = zlib.decompressobj(47 if zlib_header or self.head[:2] == b"\x1f\x8b" else -15)
            data, self.head = self.head, b""
        return self.current.decompress(data, max_length or 0)


def decode_kept(raw: bytes, content_encoding: str | None, marks: list | None = None,
                limit: int | None = None) -> tuple[bytes, list, str | None, bool]:
    """Off the loop: a kept body decoded, chunk by chunk as it arrived (``marks``: (end offset, time) per
    chunk; their offsets become the decoded ones). Returns (data, marks, problem, cut): on a problem, only
    what decoded before it (undecoded bytes cannot be redacted, so they are never kept); ``cut`` when the
    decoded body passed ``limit`` and was cut there (nothing much past it is ever decoded)."""
    try:
        decompress = decompressor(content_encoding, limit or None)
    except ValueError as exc:
        return b"", [], f"body could not be decoded: {exc}", False
    if decompress is None:
        return raw, list(marks or []), None, False
    out, kept_marks, start = bytearray(), [], 0
    try:
        for end, at in (list(marks) if marks else [(len(raw), None)]):
            out += decompress(raw[start:end])
            if limit and len(out) > limit:
                return _cut(out, limit, kept_marks, at)
            kept_marks.append((len(out), at))
            start = end
        if start < len(raw):  # bytes past the last mark: decoded, with no mark of their own
            out += decompress(raw[start:])
            if limit and len(out) > limit:
                return _cut(out, limit, kept_marks, None)
    except Exception as exc:
        return bytes(out[:limit] if limit else out), kept_marks, \
            f"body could not be decoded ({content_encoding}): {exc}", False
    return bytes(out), kept_marks, None, False


def _cut(out: bytearray, limit: int, kept_marks: list, at) -> tuple[bytes, list, None, bool]:
    kept_marks.append((limit, at))
    return bytes(out[:limit]), kept_marks, None, True


class _ZstdFrames:
    """Streaming zstd decoding across frame boundaries (mitmproxy ships backports.zstd before 3.14)."""

    def __init__(self):
        try:
            from compression import zstd
        except ImportError:
            from backports import zstd
        self.zstd = zstd
        self.current = zstd.ZstdDecompressor()

    def decompress(self, data: bytes, max_length: int | None = None) -> bytes:
        out, left = [], max_length
        while data:
            piece = self.current.decompress(data, -1 if left is None else left)
            out.append(piece)
            if left is not None:
                left -= len(piece)
                if left <= 0:
                    break  # the rest stays in the decoder: the caller wants no more
            if not self.current.eof:
                break
            data = self.current.unused_data
            self.current = self.zstd.ZstdDecompressor()
        return b"".join(out)


@dataclass
class Assembled:
    completion: object  # protocols.Completion
    first_output_at: float | None
    terminal: bool


def assemble(assembler, raw: bytes, marks: list, content_encoding: str | None, split=events_of) -> Assembled:
    """Off the loop: rebuild the completion from the upstream's bytes, chunk by chunk as they came,
    so the time of the first output event is known. ``split``: the protocol's events (``Protocol.split``:
    SSE unless it streams otherwise). Never raises."""
    data, marks, problem, _ = decode_kept(bytes(raw), content_encoding, marks)
    bounds = list(marks) if marks else ([(len(data), None)] if data else [])
    return _assemble_plain(assembler, data, bounds, [problem] if problem else [], split)


def _assemble_plain(assembler, raw: bytes, bounds: list, notes: list[str], split) -> Assembled:
    """A decoded stream, split at once; the first output event's time is that of the chunk it
    arrived in (the first mark at or past its end)."""
    first_output_at = None
    ends = [end for end, _ in bounds]
    try:
        for end, name, data in split(raw):
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
        completion = Completion(status="error", error=f"stream could not be reassembled: {exc}")
    if notes:
        completion.notes = list(completion.notes) + notes
        if completion.status == "ok":
            completion.status, completion.error = "error", "; ".join(notes)
    return Assembled(completion, first_output_at, bool(assembler.terminal))


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
