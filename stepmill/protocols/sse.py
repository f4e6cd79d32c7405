"""Incremental Server-Sent Events decoding for bytes pushed in arbitrary chunks.

mitmproxy hands a stream callable one chunk at a time; the SSE clients on PyPI (httpx-sse,
sseclient) pull from an iterator instead and keep their decoders private, so this follows
the WHATWG event-stream rules directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(r"\r\n|\n|\r")


@dataclass
class Event:
    event: str | None
    data: str
    raw: bytes  # the event's bytes, terminator included


def parse_block(block: bytes) -> tuple[str | None, str | None]:
    event, data = None, []
    for line in _LINE.split(block.decode("utf-8", errors="replace")):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    return event, ("\n".join(data) if data else None)


class SSEDecoder:
    def __init__(self):
        self.buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already searched for a boundary

    @property
    def pending(self) -> bytes:
        """Bytes of an event not finished yet."""
        return bytes(self.buffer)

    def push(self, chunk: bytes) -> list[Event]:
        """Feed bytes; return the events completed by them.

        Each byte is searched once (a boundary is at most 4 bytes, so the search restarts 3 bytes
        back): one large event arriving in many small chunks costs linear time, not quadratic.
        """
        self.buffer += chunk
        events = []
        start = 0
        pos = max(0, self._scanned - 3)
        while True:
            found = _BOUNDARY.search(self.buffer, pos)
            if not found:
                break
            raw = bytes(self.buffer[start: found.end()])
            event, data = parse_block(raw[: found.start() - start])
            if data is not None:
                events.append(Event(event, data, raw))
            elif raw.strip():
                events.append(Event(event, "", raw))  # comments and keep-alives: passed on, not parsed
            start = pos = found.end()
        if start:
            del self.buffer[:start]
        self._scanned = len(self.buffer)
        return events

    def flush(self) -> list[Event]:
        """At the end of the stream: a last event without its blank line still counts."""
        rest = bytes(self.buffer)
        self.buffer.clear()
        self._scanned = 0
        if not rest.strip():
            return [Event(None, "", rest)] if rest else []
        event, data = parse_block(rest)
        return [Event(event, data or "", rest)]


def events_of(data: bytes) -> list[tuple[int, str | None, str]]:
    """Every event of a whole stream, with the byte offset where it ends: (end, event name, data).

    For the writer, which has the whole body: one split instead of a scan per chunk, and the common
    shape (``data: …`` alone, ``\n\n`` between events) without the general line parser.
    """
    if b"\r" in data:  # CR line endings: the general decoder
        decoder, out, pos = SSEDecoder(), [], 0
        for event in decoder.push(data) + decoder.flush():
            pos += len(event.raw)
            if event.data:
                out.append((pos, event.event, event.data))
        return out
    out, pos = [], 0
    for block in data.split(b"\n\n"):
        pos = min(pos + len(block) + 2, len(data))
        if block.startswith(b"data: ") and b"\n" not in block:
            if len(block) > 6:
                out.append((pos, None, block[6:].decode("utf-8", "replace")))
        elif block.strip():
            event, value = parse_block(block)
            if value:
                out.append((pos, event, value))
    return out
