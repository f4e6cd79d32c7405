"""The stepmill mitmproxy addon: one step record per LLM call.

Hooks follow the life of a flow: ``request`` recognises an LLM call (and answers the control
API), ``responseheaders`` taps streams, ``response`` / ``error`` write the step, and the
``websocket_*`` hooks turn each Responses ``response.create`` turn into a step.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from stepmill.store.db import Store
from stepmill.store.records import StepRecord

from . import engine, tagging
from .control_api import PREFIX as CONTROL_PREFIX
from .control_api import ControlAPI, Endpoints
from .protocols import Completion, ParsedRequest, ProtocolError, match, openai_responses
from .protocols.base import load_json_object
from .stream_tap import StreamTap

log = logging.getLogger("stepmill")
RAW_LIMIT = 64 * 1024 * 1024  # raw bodies above this are cut, with a note


@dataclass
class Capture:
    """What the addon knows about one LLM call while it is in flight."""

    api: str
    module: Any
    host: str
    path: str
    started: float
    tags: tagging.Tags
    session_id: str | None
    headers: dict
    raw_request: bytes
    request: ParsedRequest | None = None
    parse_error: str | None = None
    added: engine.Added = field(default_factory=engine.Added)
    tap: StreamTap | None = None
    recorded: bool = False


@dataclass
class Turn:
    """One ``response.create`` on a Responses WebSocket, until its terminal event."""

    request: ParsedRequest | None
    raw: list[bytes]
    started: float
    parse_error: str | None = None
    assembler: openai_responses.StreamAssembler = field(default_factory=openai_responses.StreamAssembler)
    first_output_at: float | None = None


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).isoformat(timespec="milliseconds")


class StepmillAddon:
    def __init__(self):
        self.store: Store | None = None
        self.control: ControlAPI | None = None
        self.connection_tags: dict[str, tagging.Tags] = {}
        self.turns: dict[str, Turn] = {}
        # Responses that primed a WebSocket (generate: false) are no steps, but later turns chain to them.
        self.warmups: OrderedDict[str, tuple[list, list]] = OrderedDict()

    # -- set-up ---------------------------------------------------------------------------
    def load(self, loader):
        loader.add_option("stepmill_db", str, "stepmill.db", "SQLite file the steps are written to.")
        loader.add_option("stepmill_hosts", Sequence[str], [],
                          "Capture only these hosts. Empty: any host whose path is an LLM API path.")
        loader.add_option("stepmill_keep_raw", bool, False,
                          "Keep raw request and response bodies for every step, not only failed ones.")
        loader.add_option("stepmill_channel", str, "train", "Channel stamped on captured steps.")
        loader.add_option("stepmill_engine_hosts", str, "auto",
                          "Hosts treated as open-model engines (vLLM, SGLang) asked for token ids: "
                          "'auto' (any host but the closed APIs), 'none', or a comma list of host[:port].")
        loader.add_option("stepmill_engine_inject", bool, True,
                          "Ask engines for token ids and logprobs the agent did not ask for.")
        loader.add_option("stepmill_engine_strip", bool, True,
                          "Remove from the agent's response the fields only that request caused.")
        loader.add_option("stepmill_control_host", str, "stepmill.local",
                          "Host name the control API answers on through the proxy (no DNS needed).")

    def configure(self, updated):
        if "stepmill_db" in updated or self.store is None:
            if self.store is not None:
                self.store.close()
            self.store = Store(ctx.options.stepmill_db)
            self.control = ControlAPI(self.store, self._endpoints)
            log.info(f"stepmill: writing steps to {self.store.path}")

    def done(self):
        if self.store is not None:
            self.store.close()
            self.store = None

    def _endpoints(self) -> Endpoints:
        ends = Endpoints()
        for spec in ctx.options.mode:
            try:
                mode = mode_specs.ProxyMode.parse(spec)
            except ValueError:
                continue
            host = mode.listen_host(ctx.options.listen_host) or "127.0.0.1"
            port = mode.listen_port(ctx.options.listen_port)
            url = f"http://{host}:{port}"
            if isinstance(mode, mode_specs.RegularMode) and not ends.proxy:
                ends.proxy = url
            elif isinstance(mode, mode_specs.ReverseMode) and not ends.reverse and mode.data != f"http://{ctx.options.stepmill_control_host}":
                ends.reverse = url
        return ends

    # -- hooks ----------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow):
        tags = tagging.from_proxy_authorization(flow.request.headers.get("proxy-authorization"))
        if tags:
            self.connection_tags[flow.client_conn.id] = tags

    def client_disconnected(self, client):
        self.connection_tags.pop(client.id, None)

    def request(self, flow: http.HTTPFlow):
        try:
            self._request(flow)
        except Exception:
            log.exception("stepmill: request hook failed; the call passes through uncaptured")

    def responseheaders(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or flow.response is None:
            return
        try:
            if "text/event-stream" in flow.response.headers.get("content-type", ""):
                rewrite = None
                if capture.added and ctx.options.stepmill_engine_strip:
                    rewrite = lambda payload: engine.strip(payload, capture.added)  # noqa: E731
                capture.tap = StreamTap(capture.module.StreamAssembler(capture.api), rewrite=rewrite,
                                        content_encoding=flow.response.headers.get("content-encoding"))
                if rewrite is not None and "content-encoding" in flow.response.headers:
                    del flow.response.headers["content-encoding"]  # rewritten events go out decoded
                flow.response.stream = capture.tap
        except Exception:
            log.exception("stepmill: responseheaders hook failed")

    def response(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.recorded or flow.response is None or flow.response.status_code == 101:
            return
        try:
            self._finish_http(flow, capture)
        except Exception as exc:
            log.exception("stepmill: response hook failed")
            self._record_failure(capture, f"stepmill could not record this call: {exc}", flow)

    def error(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.recorded or flow.websocket is not None:
            return
        try:
            message = flow.error.msg if flow.error else "connection failed"
            if capture.tap is not None:
                completion = capture.tap.finish()
                completion.status = "incomplete"
                completion.error = f"{message} (stream cut after {len(capture.tap.raw)} bytes)"
                self._record(capture, completion, flow, transport="sse", raw_response=bytes(capture.tap.raw))
            else:
                self._record(capture, Completion(status="error", error=message), flow, transport="http",
                             raw_response=flow.response.raw_content if flow.response else None)
        except Exception as exc:
            log.exception("stepmill: error hook failed")
            self._record_failure(capture, f"stepmill could not record this call: {exc}", flow)

    # -- HTTP ------------------------------------------------------------------------------
    def _request(self, flow: http.HTTPFlow):
        request = flow.request
        if request.host == ctx.options.stepmill_control_host or request.pretty_host == ctx.options.stepmill_control_host \
                or request.path.startswith(CONTROL_PREFIX + "/"):
            self._answer_control(flow)
            return
        tags = tagging.Tags()
        tagged = tagging.split_tag_path(request.path)
        if tagged:
            tags, request.path = tagged
        tags = tags.merge(tagging.pop_header_tags(request.headers))
        tags = tags.merge(self.connection_tags.get(flow.client_conn.id))
        tags = tags.merge(tagging.from_proxy_authorization(request.headers.get("proxy-authorization")))
        found = match(request.path)
        host = request.pretty_host
        if found is None:
            return
        hosts = {h.strip() for value in ctx.options.stepmill_hosts for h in value.split(",") if h.strip()}
        if hosts and host not in hosts:
            return
        api, module = found
        websocket = request.method == "GET" and request.headers.get("upgrade", "").lower() == "websocket"
        if request.method != "POST" and not (websocket and module is openai_responses):
            return
        raw = request.get_content(strict=False) or b""
        capture = Capture(
            api=api, module=module, host=host, path=request.path.split("?", 1)[0],
            started=request.timestamp_start or time.time(), tags=tags,
            session_id=tagging.session_id(request.headers), headers=tagging.identifying_headers(request.headers),
            raw_request=raw[:RAW_LIMIT],
        )
        flow.metadata["stepmill"] = capture
        if websocket:
            return
        try:
            body = load_json_object(raw, "request body")
            capture.request = module.parse_request(body, api)
        except ProtocolError as exc:
            capture.parse_error = str(exc)
            return
        if ctx.options.stepmill_engine_inject and engine.is_engine(host, request.port, api, ctx.options.stepmill_engine_hosts):
            capture.added = engine.inject(body, api)
            if capture.added:
                request.set_content(json.dumps(body, ensure_ascii=False).encode())

    def _finish_http(self, flow: http.HTTPFlow, capture: Capture):
        response = flow.response
        if capture.tap is not None:
            completion = capture.tap.finish()
            self._record(capture, completion, flow, transport="sse", raw_response=bytes(capture.tap.raw))
            return
        body = response.get_content(strict=False) or b""
        if response.status_code >= 400:
            completion = Completion(status="error", error=f"upstream answered {response.status_code}: "
                                    f"{body[:2000].decode('utf-8', 'replace')}")
        else:
            try:
                payload = load_json_object(body, "response body")
                completion = capture.module.parse_response(payload, capture.api)
                if capture.added and ctx.options.stepmill_engine_strip and engine.strip(payload, capture.added):
                    response.set_content(json.dumps(payload, ensure_ascii=False).encode())
            except ProtocolError as exc:
                completion = Completion(status="error", error=str(exc))
        self._record(capture, completion, flow, transport="http", raw_response=body)

    # -- WebSocket (Responses) ----------------------------------------------------------------
    def websocket_message(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or flow.websocket is None:
            return
        try:
            self._websocket_message(flow, capture)
        except Exception:
            log.exception("stepmill: websocket_message hook failed")

    def websocket_end(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        turn = self.turns.pop(flow.id, None)
        if capture is None or turn is None:
            return
        try:
            reason = flow.websocket.close_reason if flow.websocket else None
            self._finish_turn(flow, capture, turn, cut=f"WebSocket closed before the turn ended"
                                                     f" (code {flow.websocket.close_code if flow.websocket else '?'}"
                                                     f"{', ' + reason if reason else ''})")
        except Exception:
            log.exception("stepmill: websocket_end hook failed")

    def _websocket_message(self, flow: http.HTTPFlow, capture: Capture):
        message = flow.websocket.messages[-1]
        content = message.content
        if message.from_client:
            try:
                payload = load_json_object(content, "WebSocket frame")
            except ProtocolError as exc:
                payload, error = None, str(exc)
            else:
                error = None
            if payload is not None and payload.get("type") != "response.create":
                return  # other client frames (steering, pings) are not turns
            pending = self.turns.pop(flow.id, None)
            if pending is not None:
                self._finish_turn(flow, capture, pending, cut="a new response.create arrived before this turn ended")
            turn = Turn(request=None, raw=[content], started=message.timestamp, parse_error=error)
            if payload is not None:
                try:
                    turn.request = openai_responses.parse_request(payload)
                except ProtocolError as exc:
                    turn.parse_error = str(exc)
            self.turns[flow.id] = turn
            return
        turn = self.turns.get(flow.id)
        if turn is None:
            return
        turn.raw.append(content)
        try:
            turn.assembler.feed(None, content.decode("utf-8", "replace"))
        except Exception as exc:
            turn.assembler.notes.append(f"unparsed frame {content[:200]!r}: {exc}")
        if turn.first_output_at is None and turn.assembler.output_started:
            turn.first_output_at = message.timestamp
        if turn.assembler.terminal:
            self.turns.pop(flow.id, None)
            self._finish_turn(flow, capture, turn)

    def _finish_turn(self, flow, capture: Capture, turn: Turn, cut: str | None = None):
        completion = turn.assembler.finish()
        if cut and completion.status == "ok":
            completion.status, completion.error = "incomplete", cut
        elif cut:
            completion.error = f"{completion.error}; {cut}" if completion.error else cut
        request = turn.request
        if request is not None and not request.generate:
            if completion.response_id:
                messages, wire = self._resolve_chain(request)
                self.warmups[completion.response_id] = (messages, wire + list(completion.wire))
                while len(self.warmups) > 1024:
                    self.warmups.popitem(last=False)
            return
        end = time.time()
        ttft = (turn.first_output_at - turn.started) * 1000 if turn.first_output_at else None
        raw_request = b"\n".join(turn.raw[:1])
        raw_response = b"\n".join(turn.raw[1:])
        self._write(capture, request, turn.parse_error, completion, transport="websocket", started=turn.started,
                    ended=end, ttft_ms=ttft, http_status=101, raw_request=raw_request, raw_response=raw_response)

    # -- writing steps ----------------------------------------------------------------------
    def _resolve_chain(self, request: ParsedRequest) -> tuple[list, list]:
        """The full conversation of a Responses request that names its previous response."""
        if not request.previous_response_id:
            return request.messages, request.wire_messages
        base = self.warmups.get(request.previous_response_id)
        if base is None:
            rows = self.store.query("SELECT id FROM steps WHERE response_id = ? ORDER BY started_at DESC LIMIT 1",
                                    [request.previous_response_id])
            base = self.store.continuation(rows[0]["id"]) if rows else None
        if base is None:
            return request.messages, request.wire_messages
        base_messages, base_wire = base
        system = [m for m in request.messages[:1] if m.get("role") == "system"]
        history = base_messages[1:] if base_messages and base_messages[0].get("role") == "system" else base_messages
        return system + list(history) + request.messages[len(system):], list(base_wire) + list(request.wire_messages)

    def _record(self, capture: Capture, completion: Completion, flow: http.HTTPFlow, *, transport: str,
                raw_response: bytes | None):
        response = flow.response
        end = (response.timestamp_end if response and response.timestamp_end else None) or time.time()
        if capture.tap is not None and capture.tap.first_output_at:
            ttft = (capture.tap.first_output_at - capture.started) * 1000
        elif response is not None and response.timestamp_start and transport == "http":
            ttft = (response.timestamp_start - capture.started) * 1000
        else:
            ttft = None
        self._write(capture, capture.request, capture.parse_error, completion, transport=transport,
                    started=capture.started, ended=end, ttft_ms=ttft,
                    http_status=response.status_code if response else None,
                    raw_request=capture.raw_request, raw_response=raw_response)

    def _write(self, capture: Capture, request: ParsedRequest | None, parse_error: str | None,
               completion: Completion, *, transport: str, started: float, ended: float, ttft_ms: float | None,
               http_status: int | None, raw_request: bytes | None, raw_response: bytes | None):
        status, error = completion.status, completion.error
        if parse_error:
            status, error = "error", parse_error + (f"; {error}" if error else "")
        notes = list(completion.notes)
        messages, wire = self._resolve_chain(request) if request is not None else ([], [])
        if request is not None and request.previous_response_id and messages is request.messages:
            notes.append(f"previous_response_id {request.previous_response_id} was not seen by this proxy;"
                         " the conversation starts at this request")
        if completion.prompt_ids is None and completion.response_ids is not None:
            notes.append("the engine returned response ids without prompt ids")
        keep_raw = ctx.options.stepmill_keep_raw or status != "ok" or bool(notes)
        version = self.store.policy_version()
        choices = [completion] + completion.alternatives
        for index, choice in enumerate(choices):
            metadata = {"notes": notes} if notes and index == 0 else {}
            if len(choices) > 1:
                metadata["choice_index"] = index  # n > 1: each choice is its own rollout of this prompt
            if index:
                status, error = choice.status, choice.error
            self.store.record_step(self._step_record(
                capture, request, choice, messages, wire, transport=transport, status=status, error=error,
                http_status=http_status, ttft_ms=ttft_ms, started=started, ended=ended, version=version,
                metadata=metadata or None, raw_request=raw_request if keep_raw and not index else None,
                raw_response=raw_response if keep_raw and not index else None))
        capture.recorded = transport != "websocket"  # a WebSocket records one step per turn

    def _step_record(self, capture: Capture, request: ParsedRequest | None, completion: Completion, messages: list,
                     wire: list, *, transport: str, status: str, error: str | None, http_status: int | None,
                     ttft_ms: float | None, started: float, ended: float, version: str | None,
                     metadata: dict | None, raw_request: bytes | None, raw_response: bytes | None) -> StepRecord:
        return StepRecord(
            api=capture.api,
            transport=transport,
            host=capture.host,
            path=capture.path,
            model=completion.model or (request.model if request else None),
            response_id=completion.response_id,
            params=request.params if request else {},
            tools=request.tools if request else None,
            messages=messages,
            wire_messages=wire,
            completion=completion.message,
            wire_completion=completion.wire,
            finish_reason=completion.finish_reason,
            usage=completion.usage,
            status=status,
            error=error,
            http_status=http_status,
            ttft_ms=ttft_ms,
            duration_ms=(ended - started) * 1000,
            started_at=_iso(started),
            headers=capture.headers,
            trajectory_id=capture.tags.trajectory_id,
            group_id=capture.tags.group_id,
            channel=capture.tags.channel or ctx.options.stepmill_channel,
            session_id=capture.session_id or (request.session_id if request else None),
            previous_response_id=request.previous_response_id if request else None,
            policy_version=version,
            metadata=metadata,
            raw_request=raw_request,
            raw_response=raw_response,
            prompt_ids=completion.prompt_ids,
            response_ids=completion.response_ids,
            logprobs=completion.logprobs,
            token_provenance="exact" if completion.response_ids is not None else None,
        )

    def _record_failure(self, capture: Capture, message: str, flow: http.HTTPFlow):
        """Last resort: keep the raw exchange with an error, so nothing is lost."""
        if capture.recorded:
            return
        capture.recorded = True
        try:
            self.store.record_step(StepRecord(
                api=capture.api, host=capture.host, path=capture.path, status="error", error=message,
                started_at=_iso(capture.started), headers=capture.headers,
                trajectory_id=capture.tags.trajectory_id, group_id=capture.tags.group_id,
                raw_request=capture.raw_request,
                raw_response=(capture.tap and bytes(capture.tap.raw)) or (flow.response.raw_content if flow.response else None),
            ))
        except Exception:
            log.exception("stepmill: could not record the failure either")

    # -- control API ----------------------------------------------------------------------------
    def _answer_control(self, flow: http.HTTPFlow):
        status, payload = self.control.handle(flow.request.method, flow.request.path,
                                              flow.request.get_content(strict=False) or b"")
        flow.response = http.Response.make(
            status, json.dumps(payload, ensure_ascii=False, default=str).encode(),
            {"Content-Type": "application/json"},
        )
