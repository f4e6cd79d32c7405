"""The record of one finished call: built once on the event loop, enriched off it, mapped to a step.

Built on the event loop (references to facts the hooks already know; nothing is parsed there) and
handed over with the call's bodies. The handoff thread cleans it (bodies decoded and redacted: it
says what could not be, and what was cut) and appends it to the journal; the writer reads it back,
stamps the policy version in effect when the call started, notes when the first output arrived, and
``recording`` maps it to the steps row. It is written to the journal's bytes and read from them
here, and only here.

A journal entry's header is JSON: ``{"version": 2, "kind": ..., "call": {...}, ...}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from stepmill import tags as tagging
from stepmill.pipeline.journal import decode_entry, entry_parts

VERSION = 2
KINDS = ("http", "sse", "websocket", "failure")  # a whole body, a tapped stream, a WebSocket turn, a hook that failed
TRANSPORTS = {"sse": "sse", "websocket": "websocket"}  # a step's transport by kind; anything else is http


@dataclass
class Call:
    """Who made a call and where it went: everything a step needs besides the exchange itself."""

    api: str  # the protocol the agent spoke
    host: str
    path: str  # where the request went (the engine's chat completions, for a translated call)
    tags: tagging.Tags = field(default_factory=tagging.Tags)
    session_id: str | None = None
    headers: dict | None = None  # allowlisted (redaction.allowed_headers), values redacted before the journal
    client_conn: str | None = None
    default_channel: str | None = None
    engine_api: str | None = None  # the protocol of the exchange kept, when the proxy translated the call to it

    @property
    def wire_api(self) -> str:
        """The protocol the kept bodies are in: the engine's, for a translated call, else the agent's."""
        return self.engine_api or self.api


@dataclass
class CallRecord:
    """One finished call: the facts the hooks know, beside the blobs (request, response or frames)."""

    kind: str  # one of KINDS
    call: Call
    started: float = 0.0  # the request's first byte (a WebSocket turn: its response.create frame)
    ended: float | None = None
    # Set on the loop
    render_with: str | None = None  # a vLLM engine's root, whose /tokenize renders ids the call did not give
    keep_raw: bool = False
    max_body: int | None = None  # bytes kept of a body (stepmill_max_body); 0 or None: no limit
    request_encoding: str | None = None  # Content-Encoding of blob 0; None once the handoff decoded it
    response_encoding: str | None = None  # Content-Encoding of blob 1; None once the handoff decoded it
    error: str | None = None  # the connection's error, or why a hook failed (kind "failure")
    http_status: int | None = None  # a WebSocket turn: 101, its upgrade's
    websocket_upgrade: bool = False  # a WebSocket upgrade the upstream refused: recorded as HTTP
    # When the first output arrived: a whole body's first byte (on the loop), a stream's or a turn's first
    # output event (in the writer, which reassembles it): what time to first token is measured to.
    response_started: float | None = None
    received: int | None = None  # response bytes the upstream sent, kept or not
    marks: list[tuple[int, float | None]] | None = None  # a stream's (end offset, time) per chunk
    notes: list[str] = field(default_factory=list)
    cut: str | None = None  # why a WebSocket turn ended before its terminal event
    frames: list[tuple[float, int]] = field(default_factory=list)  # a turn's (time, blob index) per server frame
    # Set by the handoff thread
    request_problem: str | None = None  # why blob 0 could not be decoded
    response_problem: str | None = None
    truncated: list[str] = field(default_factory=list)  # what was cut for recording (stepmill_max_body)
    # Set by the writer: the version in effect when the call started, from the file's history (never
    # the loop's: any worker, a replay, a version set a moment ago all give the same answer)
    policy_version: str | None = None

    @property
    def transport(self) -> str:
        return TRANSPORTS.get(self.kind, "http")

    def raw_bodies(self, blobs: list[bytes]) -> tuple[bytes | None, bytes | None]:
        """(request, response) as a step keeps them raw: a WebSocket turn's response is its server frames."""
        if self.kind == "websocket":
            return (blobs[0] if blobs else None), b"\n".join(blobs[i] for _, i in self.frames if i < len(blobs))
        return (blobs[0] if blobs else None), (blobs[1] if len(blobs) > 1 else None)

    # -- the journal's bytes -------------------------------------------------------------------
    def to_header(self) -> dict:
        """The JSON header of the journal entry; fields at their defaults are left out."""
        call, tags = self.call, self.call.tags
        out: dict = {"version": VERSION, "kind": self.kind, "call": {
            **{f.name: getattr(call, f.name) for f in dataclasses.fields(Call) if f.name != "tags"},
            "tags": [tags.trajectory_id, tags.group_id, tags.channel]}}  # the secret never goes to the journal
        for f in dataclasses.fields(self):
            if f.name in ("kind", "call"):
                continue
            value = getattr(self, f.name)
            if value is None or value is False or (isinstance(value, list) and not value and f.name != "marks"):
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_header(cls, header: dict) -> "CallRecord":
        """A journal entry's header (``VERSION``); ValueError for one that is not."""
        if not isinstance(header, dict) or header.get("version") != VERSION or not isinstance(header.get("call"), dict):
            raise ValueError(f"not a version {VERSION} call record: {str(header)[:200]}")
        given = header["call"]
        call = Call(**{f.name: given.get(f.name) for f in dataclasses.fields(Call) if f.name != "tags"},
                    tags=tagging.Tags(*(given.get("tags") or [None, None, None])[:3]))
        known = {f.name for f in dataclasses.fields(cls)} - {"kind", "call"}
        record = cls(kind=header.get("kind") or "http", call=call,
                     **{name: value for name, value in header.items() if name in known})
        if record.marks is not None:
            record.marks = [(end, at) for end, at in record.marks]
        record.frames = [(at, index) for at, index in record.frames]
        return record

    def entry_parts(self, blobs: list) -> list:
        """The journal entry of this record and its blobs, as buffers for one writev."""
        return entry_parts(self.to_header(), blobs)

    @classmethod
    def from_entry(cls, payload: bytes | memoryview) -> tuple["CallRecord", list[bytes]]:
        """A journal entry's record and blobs; ValueError (or another exception) for an entry that is not one."""
        header, blobs = decode_entry(payload)
        return cls.from_header(header), blobs
