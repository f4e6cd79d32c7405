"""The stepmill mitmproxy addon: one step record per LLM call.

Hooks follow the life of a flow: ``request`` recognises an LLM call (and answers the control
API), ``responseheaders`` taps streams, ``response`` / ``error`` write the step, and the
``websocket_*`` hooks turn each Responses ``response.create`` turn into a step.

Only LLM API paths are touched. Everything else (other paths, other hosts) passes byte-identical:
tags are taken out of a request only once its path is known to be an LLM call.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from stepmill.store.db import Store
from stepmill.token import ensure_token

from . import engine, recording, secrets, tagging
from .control_api import ControlAPI, Endpoints
from .protocols import Completion, ParsedRequest, ProtocolError, match, openai_responses
from .protocols.base import load_json_object
from .recording import Call
from .stream_tap import StreamTap

log = logging.getLogger("stepmill")
RAW_LIMIT = 64 * 1024 * 1024  # raw bodies above this are cut, with a note
ENGINE_AUTH_HEADERS = ("authorization", "x-api-key", "api-key")


def hook_failed(name: str) -> None:
    """Hooks never raise into mitmproxy; the test suite reads this line to show none failed."""
    log.exception(f"stepmill: {name} hook failed")


@dataclass
class Capture:
    """What the addon knows about one LLM call while it is in flight."""

    call: Call
    module: Any
    started: float
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
    notes: list[str] = field(default_factory=list)


class StepmillAddon:
    def __init__(self):
        self.store: Store | None = None
        self.control: ControlAPI | None = None
        self.connection_tags: dict[str, tagging.Tags] = {}
        self.turns: dict[str, Turn] = {}
        self.probe = engine.EngineProbe()
        # Responses that primed a WebSocket (generate: false) are no steps, but later turns chain to them.
        self.warmups: OrderedDict[str, tuple[list, list]] = OrderedDict()

    # -- set-up ---------------------------------------------------------------------------
    def load(self, loader):
        loader.add_option("stepmill_db", str, "stepmill.db", "SQLite file the steps are written to.")
        loader.add_option("stepmill_hosts", Sequence[str], [],
                          "Capture only these hosts. Empty: any host whose path is an LLM API path.")
        loader.add_option("stepmill_keep_raw", bool, False,
                          "Keep raw request and response bodies (secrets redacted) for every step, not only failed ones.")
        loader.add_option("stepmill_channel", str, "train", "Channel of new trajectories not tagged with one.")
        loader.add_option("stepmill_engine_hosts", str, "auto",
                          "Hosts treated as open-model engines (vLLM, SGLang) asked for token ids: "
                          "'auto' (hosts that answer a probe as vLLM or SGLang), 'none', or a comma list of "
                          "host[:port] (forced).")
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
            log.info(f"stepmill: writing steps to {self.store.path}")
        if self.control is None or "stepmill_db" in updated or "confdir" in updated:
            self.control = ControlAPI(self.store, self._endpoints, token=ensure_token(ctx.options.confdir))

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
            elif isinstance(mode, mode_specs.ReverseMode) and not ends.reverse and not self._is_control_mode(mode):
                ends.reverse = url
        return ends

    def _is_control_mode(self, mode) -> bool:
        return isinstance(mode, mode_specs.ReverseMode) and mode.data == f"http://{ctx.options.stepmill_control_host}"

    def _credential_tags(self, value: str | None) -> tagging.Tags | None:
        # With mitmproxy's own proxyauth, proxy credentials are a login: never tags, never stored.
        return None if ctx.options.proxyauth else tagging.from_proxy_authorization(value)

    # -- hooks ----------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow):
        tags = self._credential_tags(flow.request.headers.get("proxy-authorization"))
        if tags:
            self.connection_tags[flow.client_conn.id] = tags

    def client_disconnected(self, client):
        self.connection_tags.pop(client.id, None)

    async def request(self, flow: http.HTTPFlow):
        try:
            capture = self._request(flow)
            if capture is not None and capture.request is not None:
                await self._maybe_inject(flow, capture)
        except Exception:
            hook_failed("request")

    def responseheaders(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or flow.response is None:
            return
        try:
            if "text/event-stream" in flow.response.headers.get("content-type", ""):
                rewrite = None
                if capture.added and ctx.options.stepmill_engine_strip:
                    rewrite = lambda payload: engine.strip(payload, capture.added)  # noqa: E731
                capture.tap = StreamTap(capture.module.StreamAssembler(capture.call.api), rewrite=rewrite,
                                        markers=engine.MARKERS,
                                        content_encoding=flow.response.headers.get("content-encoding"))
                if capture.tap.rewriting and "content-encoding" in flow.response.headers:
                    del flow.response.headers["content-encoding"]  # rewritten events go out decoded
                flow.response.stream = capture.tap
        except Exception:
            hook_failed("responseheaders")

    def response(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.recorded or flow.response is None or flow.response.status_code == 101:
            return
        try:
            self._finish_http(flow, capture)
        except Exception as exc:
            hook_failed("response")
            self._record_bare(capture, f"stepmill could not record this call: {exc}", flow)

    def error(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.recorded or flow.websocket is not None:
            return
        try:
            message = flow.error.msg if flow.error else "connection failed"
            if capture.tap is not None:
                completion = capture.tap.finish()
                # Clients close (or reset an HTTP/2 stream) right after the last event, before the body
                # ends: a stream whose terminal event arrived is whole. Only one cut before it is not.
                if not capture.tap.terminal:
                    completion.status = "incomplete"
                    completion.error = f"{message} (stream cut after {len(capture.tap.raw)} bytes)"
                self._record(capture, completion, flow, transport="sse", raw_response=bytes(capture.tap.raw))
            else:
                self._record(capture, Completion(status="error", error=message), flow, transport="http",
                             raw_response=flow.response.raw_content if flow.response else None)
        except Exception as exc:
            hook_failed("error")
            self._record_bare(capture, f"stepmill could not record this call: {exc}", flow)

    # -- HTTP ------------------------------------------------------------------------------
    def _is_control(self, flow: http.HTTPFlow) -> bool:
        mode = flow.client_conn.proxy_mode
        if self._is_control_mode(mode):
            return True  # the --control-port listener
        # Through the proxy, as plain http://stepmill.local/... (never on another host or a reverse port).
        return isinstance(mode, mode_specs.RegularMode) and flow.request.scheme == "http" \
            and flow.request.host == ctx.options.stepmill_control_host

    def _request(self, flow: http.HTTPFlow) -> Capture | None:
        if flow.response is not None:
            return None  # another addon answered already (mitmproxy's proxyauth: 407)
        request = flow.request
        if self._is_control(flow):
            self._answer_control(flow)
            return None
        tagged = tagging.split_tag_path(request.path)
        api_path = tagged[1] if tagged else request.path
        found = match(api_path)
        if found is None:
            return None  # not an LLM call: untouched
        host = request.pretty_host
        hosts = {h.strip() for value in ctx.options.stepmill_hosts for h in value.split(",") if h.strip()}
        if hosts and host not in hosts:
            return None
        api, module = found
        websocket = request.method == "GET" and request.headers.get("upgrade", "").lower() == "websocket"
        if request.method != "POST" and not (websocket and module is openai_responses):
            return None
        # An LLM call: from here on the request may be changed (tags taken out, engine fields added).
        tags = tagging.Tags()
        if tagged:
            tags, request.path = tagged
        tags = tags.merge(tagging.pop_header_tags(request.headers))
        tags = tags.merge(self.connection_tags.get(flow.client_conn.id))
        tags = tags.merge(self._credential_tags(request.headers.get("proxy-authorization")))
        raw = request.get_content(strict=False) or b""
        capture = Capture(
            call=Call(api=api, host=host, path=request.path.split("?", 1)[0], tags=tags,
                      session_id=tagging.session_id(request.headers),
                      headers=secrets.stored_headers(request.headers), client_conn=flow.client_conn.id,
                      default_channel=ctx.options.stepmill_channel),
            module=module, started=request.timestamp_start or time.time(), raw_request=raw[:RAW_LIMIT],
        )
        flow.metadata["stepmill"] = capture
        if websocket:
            return capture
        capture.request, body, capture.parse_error = recording.parse_request(module, api, raw)
        flow.metadata["stepmill_body"] = body
        return capture

    async def _maybe_inject(self, flow: http.HTTPFlow, capture: Capture) -> None:
        body = flow.metadata.pop("stepmill_body", None)
        if not ctx.options.stepmill_engine_inject or body is None:
            return
        request = flow.request
        decision = engine.configured(capture.call.host, request.port, capture.call.api,
                                     ctx.options.stepmill_engine_hosts)
        if decision is None:
            bare = request.path.split("?", 1)[0].rstrip("/")
            root = bare[: -len("/chat/completions")] if bare.endswith("/chat/completions") else bare.rsplit("/", 1)[0]
            key = (request.scheme, request.host, request.port, capture.call.host, root)
            decision = self.probe.known(key)
            if decision is None:
                auth = {k: v for k, v in request.headers.items() if k.lower() in ENGINE_AUTH_HEADERS}
                decision = await self.probe.ask(key, request.scheme, (request.host, request.port), request.host_header
                                                or request.host, root + "/models", auth, self._upstream_ssl())
        if decision:
            capture.added = engine.inject(body, capture.call.api)
            if capture.added:
                request.set_content(recording.json_bytes(body))

    @staticmethod
    def _upstream_ssl() -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=ctx.options.ssl_verify_upstream_trusted_ca or None)
        if ctx.options.ssl_insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

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
            except ProtocolError as exc:
                completion = Completion(status="error", error=str(exc))
            else:
                completion = recording.parse_response(capture.module, capture.call.api, payload)
                if capture.added and ctx.options.stepmill_engine_strip:
                    try:
                        if engine.strip(payload, capture.added):
                            response.set_content(recording.json_bytes(payload))
                    except Exception as exc:  # the agent gets the engine's body rather than none
                        completion.notes.append(f"could not remove the engine fields: {exc}")
        self._record(capture, completion, flow, transport="http", raw_response=body)

    # -- WebSocket (Responses) ----------------------------------------------------------------
    def websocket_message(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or flow.websocket is None:
            return
        try:
            self._websocket_message(flow, capture)
        except Exception:
            hook_failed("websocket_message")

    def websocket_end(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        turn = self.turns.pop(flow.id, None)
        if capture is None or turn is None:
            return
        reason = flow.websocket.close_reason if flow.websocket else None
        self._finish_turn(flow, capture, turn, cut=f"WebSocket closed before the turn ended"
                                                 f" (code {flow.websocket.close_code if flow.websocket else '?'}"
                                                 f"{', ' + reason if reason else ''})")

    def _websocket_message(self, flow: http.HTTPFlow, capture: Capture):
        message = flow.websocket.messages[-1]
        content = message.content
        if message.from_client:
            try:
                payload = load_json_object(content, "WebSocket frame")
            except ProtocolError:
                payload = None
            if payload is None or payload.get("type") != "response.create":
                return  # other client frames (steering, pings, anything unparsable) do not end a turn
            pending = self.turns.pop(flow.id, None)
            if pending is not None:
                self._finish_turn(flow, capture, pending, cut="a new response.create arrived before this turn ended")
            turn = Turn(request=None, raw=[content], started=message.timestamp)
            try:
                turn.request = openai_responses.parse_request(payload)
            except Exception as exc:
                turn.parse_error = f"response.create does not have the Responses shape: {type(exc).__name__}: {exc}"
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
        raw_request = b"\n".join(turn.raw[:1])
        raw_response = b"\n".join(turn.raw[1:])
        try:
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
            ttft = (turn.first_output_at - turn.started) * 1000 if turn.first_output_at else None
            self._write(capture, request, turn.parse_error, completion, transport="websocket", started=turn.started,
                        ended=time.time(), ttft_ms=ttft, http_status=101, raw_request=raw_request,
                        raw_response=raw_response)
        except Exception as exc:
            hook_failed("websocket turn")
            recording.save_bare(self.store, capture.call.api, f"stepmill could not record this turn: {exc}",
                                started=turn.started, transport="websocket", raw_request=raw_request,
                                raw_response=raw_response)

    # -- writing steps ----------------------------------------------------------------------
    def _resolve_chain(self, request: ParsedRequest) -> tuple[list, list]:
        """The full conversation of a Responses request that names its previous response."""
        if not request.previous_response_id:
            return request.messages, request.wire_messages
        base = self.warmups.get(request.previous_response_id)
        if base is None:
            rows = self.store.query("SELECT id FROM steps WHERE response_id = ? ORDER BY rowid DESC LIMIT 1",
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
        capture.recorded = True
        self._write(capture, capture.request, capture.parse_error, completion, transport=transport,
                    started=capture.started, ended=end, ttft_ms=ttft,
                    http_status=response.status_code if response else None,
                    raw_request=capture.raw_request, raw_response=raw_response)

    def _write(self, capture: Capture, request: ParsedRequest | None, parse_error: str | None,
               completion: Completion, *, transport: str, started: float, ended: float, ttft_ms: float | None,
               http_status: int | None, raw_request: bytes | None, raw_response: bytes | None):
        try:
            messages, wire = self._resolve_chain(request) if request is not None else ([], [])
            version = self.store.policy_version()
        except Exception as exc:
            recording.save_bare(self.store, capture.call.api, f"stepmill could not read this call: {exc}",
                                started=started, transport=transport, raw_request=raw_request,
                                raw_response=raw_response)
            return
        recording.record_call(self.store, capture.call, request, parse_error, completion, messages, wire,
                              transport=transport, started=started, ended=ended, ttft_ms=ttft_ms,
                              http_status=http_status, policy_version=version,
                              keep_raw=ctx.options.stepmill_keep_raw, raw_request=raw_request,
                              raw_response=raw_response)

    def _record_bare(self, capture: Capture, message: str, flow: http.HTTPFlow):
        """Last resort for a hook that failed: keep the raw exchange with an error, so nothing is lost."""
        if capture.recorded:
            return
        capture.recorded = True
        raw_response = (capture.tap and bytes(capture.tap.raw)) or (flow.response.raw_content if flow.response else None)
        recording.save_bare(self.store, capture.call.api, message, started=capture.started, transport="http",
                            raw_request=capture.raw_request, raw_response=raw_response)

    # -- control API ----------------------------------------------------------------------------
    def _answer_control(self, flow: http.HTTPFlow):
        status, payload = self.control.handle(flow.request.method, flow.request.path,
                                              flow.request.get_content(strict=False) or b"",
                                              authorization=flow.request.headers.get("authorization"))
        flow.response = http.Response.make(status, recording.json_bytes(payload), {"Content-Type": "application/json"})
