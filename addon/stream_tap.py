"""The callable mitmproxy calls with each chunk of a streamed response.

It passes bytes on as they arrive (the agent sees the first event before the upstream sends
the last), feeds a decoded copy to the protocol's assembler, and, when the engine was asked for
extra fields, rewrites whole events to take them out again.

mitmproxy sends whatever the callable returns; an empty ``bytes`` at the wrong moment ends an
HTTP/1 body early. So the tap always returns a *list* of chunks: empty while a rewritten event
is still partial, never an empty chunk.
"""

from __future__ import annotations

import json
import time
import zlib
from typing import Callable

from .sse import Event, SSEDecoder


def decompressor(encoding: str | None) -> Callable[[bytes], bytes] | None:
    """A streaming decoder for a Content-Encoding; None for identity. ValueError if unknown."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "deflate", "x-gzip"):
        return zlib.decompressobj(47).decompress  # 32 + 15: gzip or zlib header, detected
    if encoding == "br":
        import brotli  # a mitmproxy dependency

        return brotli.Decompressor().process
    if encoding == "zstd":
        return _ZstdFrames().decompress
    raise ValueError(f"unsupported content-encoding {encoding!r}")


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
    """``rewrite`` (payload -> changed?) is applied to events whose data contains one of ``markers``."""

    def __init__(self, assembler, *, rewrite: Callable[[dict], bool] | None = None,
                 markers: tuple[str, ...] = (), content_encoding: str | None = None):
        self.assembler = assembler
        self.rewrite = rewrite
        self.markers = markers
        self.decoder = SSEDecoder()
        self.raw = bytearray()
        self.notes: list[str] = []
        self.first_output_at: float | None = None
        self.ended = False
        self.decoding = True  # False once the copy could not be decoded: bytes still pass
        try:
            self.decompress = decompressor(content_encoding)
        except ValueError as exc:
            self.decompress = None
            self.decoding = False
            self.notes.append(str(exc))
            self.rewrite = None  # undecodable bytes are passed on as they are, with their encoding

    @property
    def rewriting(self) -> bool:
        """True when the agent gets the tap's (decoded) events instead of the upstream's bytes."""
        return self.rewrite is not None

    def __call__(self, chunk: bytes) -> list[bytes]:
        self.raw += chunk
        if not chunk:
            self.ended = True
        if not self.rewriting:
            if self.decoding:
                self._decode(chunk)
            return [chunk] if chunk else []
        events = self._decode(chunk)
        if events is None:  # the upstream's compressed bytes are broken: nothing plain can follow
            return []
        out = b"".join(self._feed(event) for event in events)
        return [out] if out else []

    def _decode(self, chunk: bytes) -> list[Event] | None:
        try:
            data = self.decompress(chunk) if (self.decompress and chunk) else chunk
        except Exception as exc:
            self.notes.append(f"stream could not be decompressed: {exc}")
            self.decoding = False
            return None
        if not self.decoding:
            return None
        events = self.decoder.push(data) if chunk else self.decoder.flush()
        if not self.rewriting:
            for event in events:
                self._feed(event)
        return events

    def _feed(self, event: Event) -> bytes:
        """Give one event to the assembler; the bytes the agent gets for it."""
        if not event.data:
            return event.raw
        try:
            self.assembler.feed(event.event, event.data)
        except Exception as exc:
            self.notes.append(f"unparsed stream event {event.data[:200]!r}: {exc}")
            return event.raw
        if self.first_output_at is None and self.assembler.output_started:
            self.first_output_at = time.time()
        if self.rewrite is None or not any(m in event.data for m in self.markers):
            return event.raw
        try:
            payload = json.loads(event.data)
            if not isinstance(payload, dict) or not self.rewrite(payload):
                return event.raw
            body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        except Exception as exc:  # the agent gets the event as it came rather than a broken one
            self.notes.append(f"could not rewrite a stream event: {exc}")
            return event.raw
        prefix = f"event: {event.event}\n".encode() if event.event else b""
        return prefix + b"data: " + body + b"\n\n"

    @property
    def terminal(self) -> bool:
        """The protocol's last event arrived: the completion is whole even if the connection is cut now."""
        return bool(getattr(self.assembler, "terminal", False))

    def finish(self):
        if not self.ended and self.decoding and self.decoder.buffer:
            for event in self.decoder.flush():
                self._feed(event)
        completion = self.assembler.finish()
        if self.notes:
            completion.notes = completion.notes + self.notes
            if completion.status == "ok":
                completion.status, completion.error = "error", "; ".join(self.notes)
        return completion
