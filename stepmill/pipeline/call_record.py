"""The record of one finished call, as the event loop hands it to the pipeline.

Built on the event loop (references to facts the hooks already know; nothing is parsed there),
read off it: by the handoff thread, which cleans it and appends it to the journal, and by the
writer, which reads it back from the journal and records the step. It is written to the
journal's bytes and read from them here, and only here.

A journal entry's header is JSON. Version 2 (``VERSION``) nests the call under ``"call"`` and
says its version; entries left by the previous release are flat dicts without a version, and
are still read (a journal left on disk by it replays).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from stepmill import tags as tagging
from stepmill.pipeline.journal import decode_entry, entry_parts
from stepmill.protocols import protocols
from stepmill.protocols.openai_chat import CHAT

VERSION = 2
KINDS = ("http", "sse", "websocket", "failure")  # a whole body, a tapped stream, a WebSocket turn, a hook that failed


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
    version: int = VERSION
    # Set on the loop
    render_with: str | None = None  # a vLLM engine's root, whose /tokenize renders ids the call did not give
    policy_version: str | None = None
    keep_raw: bool = False
    max_body: int | None = None  # bytes kept of a body (stepmill_max_body); 0 or None: no limit
    request_encoding: str | None = None  # Content-Encoding of blob 0; None once the handoff decoded it
    response_encoding: str | None = None  # Content-Encoding of blob 1; None once the handoff decoded it
    error: str | None = None  # the connection's error, or why a hook failed (kind "failure")
    http_status: int | None = None
    websocket_upgrade: bool = False  # a WebSocket upgrade the upstream refused: recorded as HTTP
    response_started: float | None = None  # a whole body's first byte (time to first token)
    received: int | None = None  # response bytes the upstream sent, kept or not
    marks: list[tuple[int, float | None]] | None = None  # a stream's (end offset, time) per chunk
    notes: list[str] = field(default_factory=list)
    cut: str | None = None  # why a WebSocket turn ended before its terminal event
    frames: list[tuple[float, int]] = field(default_factory=list)  # a turn's (time, blob index) per server frame
    # Set by the handoff thread
    request_problem: str | None = None  # why blob 0 could not be decoded
    response_problem: str | None = None
    truncated: list[str] = field(default_factory=list)  # what was cut for recording (stepmill_max_body)

    # -- the journal's bytes -------------------------------------------------------------------
    def to_header(self) -> dict:
        """The JSON header of the journal entry; fields at their defaults are left out."""
        out: dict = {"version": VERSION, "kind": self.kind, "call": _call_header(self.call)}
        for f in dataclasses.fields(self):
            if f.name in ("version", "kind", "call"):
                continue
            value = getattr(self, f.name)
            if value is None or value is False or (isinstance(value, list) and not value and f.name != "marks"):
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_header(cls, header: dict) -> "CallRecord":
        """A journal entry's header, of this version or of the previous release (flat, no version)."""
        version = header.get("version")
        if version is None:  # the previous release: the call's fields at the top
            call = _call_from(header)
            version = 1
        else:
            call = _call_from(header.get("call") or {})
        marks = header.get("marks")
        notes = list(header.get("notes") or [])
        if call.engine_api is None and call.api == CHAT and notes:
            # journaled before engine_api: a translated call was the engine's chat exchange, and only its note
            # said whose call it was
            call.api, call.engine_api = _translated_from(notes) or (call.api, None)
        return cls(
            kind=header.get("kind") or "http", call=call, started=header.get("started") or 0.0,
            ended=header.get("ended"), version=version, render_with=header.get("render_with"),
            policy_version=header.get("policy_version"), keep_raw=bool(header.get("keep_raw")),
            max_body=header.get("max_body"), request_encoding=header.get("request_encoding"),
            response_encoding=header.get("response_encoding"), error=header.get("error"),
            http_status=header.get("http_status"), websocket_upgrade=bool(header.get("websocket_upgrade")),
            response_started=header.get("response_started"), received=header.get("received"),
            marks=None if marks is None else [(end, at) for end, at in marks],
            notes=notes, cut=header.get("cut"),
            frames=[(at, index) for at, index in header.get("frames") or []],
            request_problem=header.get("request_problem"), response_problem=header.get("response_problem"),
            truncated=list(header.get("truncated") or []))

    def entry_parts(self, blobs: list) -> list:
        """The journal entry of this record and its blobs, as buffers for one writev."""
        return entry_parts(self.to_header(), blobs)

    @classmethod
    def from_entry(cls, payload: bytes | memoryview) -> tuple["CallRecord", list[bytes]]:
        header, blobs = decode_entry(payload)
        return cls.from_header(header), blobs


def _call_header(call: Call) -> dict:
    return {"api": call.api, "host": call.host, "path": call.path,
            "tags": [call.tags.trajectory_id, call.tags.group_id, call.tags.channel],
            "session_id": call.session_id, "headers": call.headers, "client_conn": call.client_conn,
            "default_channel": call.default_channel, "engine_api": call.engine_api}


def _translated_from(notes: list[str]) -> tuple[str, str] | None:
    """(the agent's api, the engine's) of a call an earlier release journaled as the engine's chat exchange."""
    for protocol in protocols():
        if protocol.via_chat is not None and protocol.via_chat.NOTE in notes:
            return protocol.api, CHAT
    return None


def _call_from(header: dict) -> Call:
    tags = header.get("tags") or [None, None, None]
    return Call(api=header.get("api") or "", host=header.get("host") or "", path=header.get("path") or "",
                tags=tagging.Tags(*tags), session_id=header.get("session_id"), headers=header.get("headers"),
                client_conn=header.get("client_conn"), default_channel=header.get("default_channel"),
                engine_api=header.get("engine_api"))
