"""The callable mitmproxy calls with each chunk of a streamed response.

It passes bytes on as they arrive (the agent sees the first event before the upstream sends
the last), feeds a copy to the protocol's assembler, and, when the engine was asked for
extra fields, rewrites whole events to take them out again.
"""

from __future__ import annotations

import json
import time
import zlib
from typing import Callable

from .sse import Event, SSEDecoder


def _decompressor(encoding: str | None):
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "deflate", "x-gzip"):
        return zlib.decompressobj(47).decompress  # 32 + 15: gzip or zlib header, detected
    if encoding == "br":
        import brotli  # a mitmproxy dependency

        return brotli.Decompressor().process
    raise ValueError(f"unsupported content-encoding {encoding!r}")


class StreamTap:
    def __init__(self, assembler, *, rewrite: Callable[[dict], bool] | None = None,
                 content_encoding: str | None = None):
        self.assembler = assembler
        self.rewrite = rewrite
        self.decoder = SSEDecoder()
        self.raw = bytearray()
        self.notes: list[str] = []
        self.first_output_at: float | None = None
        self.ended = False
        try:
            self.decompress = _decompressor(content_encoding)
        except ValueError as exc:
            self.decompress, self.broken = None, True
            self.notes.append(str(exc))
        else:
            self.broken = False

    def __call__(self, chunk: bytes) -> bytes:
        self.raw += chunk
        if self.broken:
            return chunk
        try:
            data = self.decompress(chunk) if (self.decompress and chunk) else chunk
            events = self.decoder.push(data) if chunk else self.decoder.flush()
            if not chunk:
                self.ended = True
            out = [self._feed(event) for event in events]
        except Exception as exc:  # never break the agent's stream over a parse problem
            self.notes.append(f"stream decoding failed: {exc}")
            self.broken = True
            return chunk
        if self.rewrite is None:
            return chunk
        return b"".join(out)

    def _feed(self, event: Event) -> bytes:
        if not event.data:
            return event.raw
        try:
            self.assembler.feed(event.event, event.data)
        except Exception as exc:
            self.notes.append(f"unparsed stream event {event.data[:200]!r}: {exc}")
            return event.raw
        if self.first_output_at is None and self.assembler.output_started:
            self.first_output_at = time.time()
        if self.rewrite is None or event.data.strip() == "[DONE]":
            return event.raw
        payload = json.loads(event.data)
        if not isinstance(payload, dict) or not self.rewrite(payload):
            return event.raw
        prefix = f"event: {event.event}\n" if event.event else ""
        return f"{prefix}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def finish(self):
        completion = self.assembler.finish()
        if self.notes:
            completion.notes = completion.notes + self.notes
            if completion.status == "ok":
                completion.status, completion.error = "error", "; ".join(self.notes)
        return completion
