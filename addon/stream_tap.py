"""On the event loop: the callable mitmproxy calls with each chunk of a streamed response.

It passes bytes on as they arrive (the agent sees the first event before the upstream sends
the last) and, when the engine was asked for extra fields, rewrites whole events to take them
out again. The copy it keeps is reassembled later, off the event loop, by
``stepmill.protocols.streams.assemble``.

mitmproxy sends whatever the callable returns; an empty ``bytes`` at the wrong moment ends an
HTTP/1 body early. So the tap always returns a *list* of chunks: empty while a rewritten event
is still partial, never an empty chunk.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from stepmill.protocols.sse import Event, SSEDecoder
from stepmill.protocols.streams import decompressor


class StreamTap:
    """On the event loop: pass chunks on and keep the upstream's bytes, with when each arrived.

    Passing through (the usual case) costs an append per chunk; nothing is parsed. Only when
    ``rewrite`` is set (engine fields to take out) are events decoded, and only those whose data
    contains one of ``markers`` are parsed and re-serialised. Reassembling the completion is the
    pipeline's job (``streams.assemble``), off the loop.
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
            try:  # bounded: a bomb of a few bytes never makes more than ``limit`` on the loop
                self.decompress = decompressor(content_encoding, self.limit)
            except ValueError as exc:
                self.notes.append(f"{exc}; engine fields were left in the stream")
                self.rewrite = None  # undecodable bytes are passed on as they are, with their encoding
        self.decoding = True
        self.decoded = 0  # bytes the decompressor made
        self.reading = True  # False once an event passed the limit: decoded bytes then go on unread

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
        self.decoded += len(data) if self.decompress else 0
        if self.limit is not None and self.decoded > self.limit:
            self.notes.append(f"the stream decodes ({self.content_encoding}) to more than stepmill_max_body "
                              f"({self.limit} bytes): nothing past that was passed on")
            self.decoding = False
            return []
        if not self.reading:
            return [data] if data else []
        events = self.decoder.push(data) if chunk else self.decoder.flush()
        if self.limit is not None and len(self.decoder.buffer) > self.limit:
            return self._unread(events)
        if self.translate is not None:
            out = self._translated(events, ended=not chunk)
        else:
            out = b"".join(self._rewrite(event) for event in events)
        return [out] if out else []

    def _translated(self, events: list[Event], ended: bool) -> bytes:
        try:
            out = b"".join(self.translate(event) for event in events)
            if ended and self.translate_end is not None:
                out += self.translate_end()
            return out
        except Exception as exc:  # noted; the agent gets what translated so far, never a traceback
            self.notes.append(f"could not translate a stream event: {exc}")
            return b""

    def _unread(self, events: list[Event]) -> list[bytes]:
        """An event longer than the limit (one that may never end): the events before it as usual, then its
        bytes and the rest of the stream passed on as they come, unread (a translated stream ends there)."""
        self.reading = False
        if self.translate is not None:
            self.notes.append(f"a stream event passed stepmill_max_body ({self.limit} bytes) before it ended: "
                              "the stream could not be translated further and ends there")
            self.decoding = False
            out = self._translated(events, ended=False)
            return [out] if out else []
        self.notes.append(f"a stream event passed stepmill_max_body ({self.limit} bytes) before it ended: it and "
                          "the rest of the stream were passed on as they came, engine fields left in")
        out = b"".join(self._rewrite(event) for event in events) + bytes(self.decoder.buffer)
        self.decoder.buffer.clear()
        return [out]

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
