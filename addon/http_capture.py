"""On the event loop: LLM calls over HTTP, from their request to the record handed to the pipeline.

``request`` recognises an LLM call by its path, takes its tags out and asks ``EngineIds`` for
engine fields; ``responseheaders`` taps a stream; ``response`` / ``error`` hand the finished
exchange (references to bytes already in memory) over with its ``CallRecord``, made when the
request was recognised and completed with the response's facts. Parsing, linking
and the database happen in the pipeline, off the loop.

Only LLM API paths are touched. Everything else (other paths, other hosts) passes byte-identical:
tags are taken out of a request only once its path is known to be an LLM call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

from mitmproxy import ctx, http
from mitmproxy.net.http import url

from stepmill import tags as tagging
from stepmill.addon.engine import MARKERS
from stepmill.addon.engine_ids import EngineIds
from stepmill.addon.loop_state import Capture, LoopState, hook_failed
from stepmill.addon.stream_tap import StreamTap
from stepmill.auth.runs import Refused
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.redaction import allowed_headers
from stepmill.protocols import match, registry
from stepmill.protocols.base import json_bytes

log = logging.getLogger("stepmill")


@functools.lru_cache(maxsize=1024)
def _authority_host(authority: str) -> str:
    """The host of a Host header (or :authority), as mitmproxy's ``pretty_host`` has it: parsed once per
    value an agent sends, not once per call."""
    return tagging.stored_text(url.parse_authority(authority, check=False)[0])


def _pretty_host(request: http.Request) -> str:
    authority = request.host_header
    return _authority_host(authority) if authority else request.host


class HttpCapture:
    def __init__(self, state: LoopState):
        self.state = state
        self.engine = EngineIds()
        self.hosts: frozenset[str] = frozenset()  # stepmill_hosts, parsed when it changes: only these are recorded
        registry.load()  # the protocols, entry points included, before any call: requests only read them

    def configure(self, updated):
        if "stepmill_hosts" in updated:
            self.hosts = frozenset(h.strip() for value in ctx.options.stepmill_hosts for h in value.split(",")
                                   if h.strip())

    # -- connections: tags carried by a proxy credential -------------------------------------
    def http_connect(self, flow: http.HTTPFlow):
        tags = self._credential_tags(flow.request.headers.get("proxy-authorization"))
        if tags:
            self.state.connection_tags[flow.client_conn.id] = tags

    def client_disconnected(self, client):
        self.state.connection_tags.pop(client.id, None)

    @staticmethod
    def _credential_tags(value: str | None) -> tagging.Tags | None:
        # With mitmproxy's own proxyauth, proxy credentials are a login: never tags, never stored.
        return None if ctx.options.proxyauth else tagging.from_proxy_authorization(value)

    # -- request ----------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow):
        """Synchronous for the common case; returns a coroutine (which mitmproxy awaits) only for the
        first call to a host whose engine probe is still to be made."""
        try:
            if flow.response is not None:
                return None  # answered already (the control endpoint; mitmproxy's proxyauth: 407)
            capture = self._recognise(flow)
            if capture is None or capture.websocket:
                return None  # a WebSocket's turns are WebSocketTurns'
            return self.engine.request(flow, capture, self._forget)
        except Exception:
            hook_failed("request")
        return None

    def _recognise(self, flow: http.HTTPFlow) -> Capture | None:
        request = flow.request
        tagged = tagging.split_tag_path(request.path)
        api_path = tagged[1] if tagged else request.path
        protocol = match(api_path)
        if protocol is None:
            return None  # not an LLM call: untouched
        host = _pretty_host(request)
        if self.hosts and host not in self.hosts:
            return None
        index = tagging.header_index(request.headers)
        websocket = request.method == "GET" and index.get("upgrade", "").lower() == "websocket"
        if request.method != "POST" and not (websocket and protocol.websocket):
            return None
        # An LLM call: from here on the request may be changed (tags taken out, engine fields added).
        path_tags = None
        if tagged:
            path_tags, request.path = tagged
        headers = tagging.pop_header_tags(request.headers, index)
        request_tags = None
        if not ctx.options.proxyauth and "proxy-authorization" in index:
            request_tags = self._credential_tags(index["proxy-authorization"])
            request.headers.pop("proxy-authorization", None)  # hop-by-hop: its secret never goes upstream
        runs = self.state.runs
        door = runs.runs.get(flow.metadata.get("stepmill_door"))
        try:
            credentials = (path_tags, self.state.connection_tags.get(flow.client_conn.id), request_tags)
            if door is not None:  # a sandboxed run's door: the connection says whose call it is
                tags = runs.through_door(door, credentials, headers)
            else:
                tags = runs.resolve(runs.credential(*credentials), headers,
                                    vouched=flow.metadata.get("stepmill_vouched", False))
        except Refused as exc:
            log.warning(f"stepmill: refused {request.method} {host}{api_path}: {exc}")
            flow.response = http.Response.make(403, json_bytes({"error": {
                "message": f"stepmill refused this call: {exc}", "type": "stepmill_refused"}}),
                {"Content-Type": "application/json"})
            return None
        path = tagging.stored_text(request.path.split("?", 1)[0])  # bytes that are not UTF-8: U+FFFD
        call = Call(api=protocol.api, host=host, path=path, tags=tags,
                    session_id=tagging.session_id(index),
                    headers={name: tagging.stored_text(value) for name, value in allowed_headers(index).items()},
                    client_conn=flow.client_conn.id, default_channel=ctx.options.stepmill_channel)
        capture = Capture(
            record=CallRecord(kind="http", call=call, started=request.timestamp_start or time.time(),
                              request_encoding=index.get("content-encoding"),
                              keep_raw=ctx.options.stepmill_keep_raw, max_body=ctx.options.stepmill_max_body),
            protocol=protocol, raw_request=request.raw_content or b"", websocket=websocket)
        flow.metadata["stepmill"] = capture
        self.state.began(tags.trajectory_id)  # until handed off, or (a WebSocket) upgraded
        return capture

    def _forget(self, flow: http.HTTPFlow, capture: Capture) -> None:
        """A call that turned out not to be one to record: no step, nothing waits for it."""
        flow.metadata.pop("stepmill", None)
        capture.done = True
        self.state.settled(capture.call.tags.trajectory_id)

    # -- response ---------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if flow.response is None:
            return
        if capture is None:
            if "text/event-stream" in flow.response.headers.get("content-type", ""):
                flow.response.stream = True  # other event streams pass through as they come, not buffered
            return
        try:
            content_type = flow.response.headers.get("content-type", "")
            if "text/event-stream" not in content_type and "json" in content_type \
                    and flow.response.status_code < 400 and capture.protocol.streams_json(capture.call.path):
                # a JSON array streamed element by element: passed on as it comes, kept as it came
                capture.tap = StreamTap(content_encoding=flow.response.headers.get("content-encoding"),
                                        limit=ctx.options.stepmill_max_body)
                flow.response.stream = capture.tap
            elif "text/event-stream" in content_type:
                rewrite, translate = self.engine.stream_edits(capture)
                capture.tap = StreamTap(rewrite=rewrite, markers=MARKERS, translate=translate,
                                        translate_end=translate.close if translate else None,
                                        content_encoding=flow.response.headers.get("content-encoding"),
                                        limit=ctx.options.stepmill_max_body)
                if capture.tap.rewriting and "content-encoding" in flow.response.headers:
                    del flow.response.headers["content-encoding"]  # rewritten events go out decoded
                flow.response.stream = capture.tap
        except Exception:
            hook_failed("responseheaders")

    def response(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.done or flow.response is None:
            return
        if capture.websocket and flow.response.status_code == 101:
            capture.done = True
            self.state.settled(capture.call.tags.trajectory_id)  # the turns are steps, counted as they come
            return
        try:
            self._finish(flow, capture, error=None)
        except Exception as exc:
            hook_failed("response")
            self._hand_off_failure(capture, f"stepmill could not record this call: {exc}", flow)

    def error(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.done or flow.websocket is not None:
            return
        try:
            self._finish(flow, capture, error=flow.error.msg if flow.error else "connection failed")
        except Exception as exc:
            hook_failed("error")
            self._hand_off_failure(capture, f"stepmill could not record this call: {exc}", flow)

    def _finish(self, flow: http.HTTPFlow, capture: Capture, *, error: str | None) -> None:
        """The response's facts added to the call's record, which is handed over with the bodies."""
        response, record, tap = flow.response, capture.record, capture.tap
        record.ended = (response.timestamp_end if response and response.timestamp_end else None) or time.time()
        record.error, record.websocket_upgrade = error, capture.websocket
        record.http_status = response.status_code if response is not None else None
        if tap is not None:
            record.kind, record.marks, record.received = "sse", tap.marks, tap.received
            record.response_encoding = tap.content_encoding
            record.notes += tap.notes
            self._hand_off(capture, [capture.raw_request, tap.raw])
        elif response is None:
            self._hand_off(capture, [capture.raw_request, b""])
        else:
            body = response.raw_content or b""  # the engine's own bytes are recorded, ids and all
            record.response_started = response.timestamp_start
            record.response_encoding = response.headers.get("content-encoding")
            self.engine.whole_body(response, capture, error)
            self._hand_off(capture, [capture.raw_request, body])

    def _hand_off(self, capture: Capture, blobs: list, record: CallRecord | None = None) -> None:
        capture.done = True
        self.state.hand_off(record or capture.record, blobs)

    def _hand_off_failure(self, capture: Capture, message: str, flow: http.HTTPFlow):
        """Last resort for a hook that failed: keep the raw exchange with an error, so nothing is lost."""
        if capture.done:
            return
        tap, response = capture.tap, flow.response
        raw_response = tap.raw if tap is not None else ((response.raw_content or b"") if response is not None else b"")
        record = dataclasses.replace(
            capture.record, kind="failure", error=message, marks=None,
            response_encoding=tap.content_encoding if tap is not None else
            response.headers.get("content-encoding") if response is not None else None,
            received=tap.received if tap is not None else None)
        self._hand_off(capture, [capture.raw_request, raw_response], record)
