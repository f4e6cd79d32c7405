"""On the event loop: what a call may reach, by who sent it and where its connection really goes.

- Every caller: an engine's admin routes (``stepmill.auth.admin_routes``: weights, caches, RPC into
  its workers) are refused through the proxy unless the request carries the write token in
  ``X-Stepmill-Token`` (the trainer calls its engine directly anyway).
- A sandboxed run's door (see ``stepmill.runner.door``): the runner's side of it adds the run's door
  key (``DOOR_HEADER``) to the first request of each connection; that binds the client connection to
  the run, and every later request on it is the run's. A key no run holds is refused, the same
  whatever address it came from; an address alone is never anyone's.
- A bound connection reaches only the hosts registered with its run (its route's LLM and engines,
  ``[isolation] allow_hosts``: host and port), whatever the path or method, judged by where the
  connection goes (``request.host``/``port``, the CONNECT target; never the ``Host`` header) before
  any byte moves; ``server_connect`` checks again whatever addon rewrote the request since. A
  refused CONNECT is answered the same whether or not anything listens there. Once its run has
  ended, nothing; never raw TCP or UDP after a CONNECT.

It comes before the control endpoint and the capture, so what it refuses never reaches them (no
step of the run's, no engine probe). An LLM-shaped call a door refused for where it went is kept
once, as an error step on the ``refused`` channel that names the run and the reason.
"""

from __future__ import annotations

import hmac
import logging
import time

from mitmproxy import ctx, http, tcp, udp
from mitmproxy.proxy import mode_specs, server_hooks

from stepmill import tags as tagging
from stepmill.addon.loop_state import LoopState, hook_failed
from stepmill.auth.admin_routes import is_admin_route
from stepmill.auth.runs import DOOR_HEADER, RegisteredRun, destination
from stepmill.auth.write_token import ensure_token
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.protocols import match
from stepmill.protocols.base import json_bytes

log = logging.getLogger("stepmill")
TOKEN_HEADER = "X-Stepmill-Token"
UNKNOWN_DOOR = "no run's door holds the key this connection carried"
REFUSED_CHANNEL = "refused"  # where LLM-shaped calls a door refused are kept: never a run's, never trained on


class Doors:
    def __init__(self, state: LoopState):
        self.state = state
        self._token: str | None = None

    def _write_token(self) -> str:
        if self._token is None:
            self._token = ensure_token(ctx.options.confdir)
        return self._token

    # -- which run a connection is: its first request's door key, then one dictionary read --------------
    def _run_of(self, flow: http.HTTPFlow) -> RegisteredRun | None | bool:
        """The run the flow's connection is bound to, None for a caller that is no run's, or False for a
        door key no run holds. The key is taken out of the request wherever it is."""
        connection = flow.client_conn.id
        key = flow.request.headers.pop(DOOR_HEADER, None)  # never sent on
        run = self.state.runs.at_door(connection)
        if run is not None or key is None:
            return run  # a key on a bound connection binds nothing more
        return self.state.runs.bind(connection, key) or False

    def _door_run(self, flow: http.HTTPFlow) -> RegisteredRun | None:
        """The run whose door a flow came through, to be checked for where it goes; None for a flow from
        no door, or one refused here already (a key no run holds, a run that has ended)."""
        run = self._run_of(flow)
        if run is False:
            return self._refuse(flow, UNKNOWN_DOOR)
        if run is None:
            return None
        flow.metadata["stepmill_door"] = run.trajectory_id
        if run.revoked:
            return self._refuse(flow, f"run {run.trajectory_id!r} has ended: its credentials were revoked")
        return run

    def client_disconnected(self, client):
        self.state.runs.unbind(client.id)

    # -- plain requests and WebSocket upgrades: judged on their head, before the body is read ---------
    def requestheaders(self, flow: http.HTTPFlow):
        try:
            run = self._door_run(flow)  # bound first, whatever answered: a later request on this connection is the run's
            if flow.response is not None:
                return
            if run is not None and not self._is_control(flow) and not self._reaches(run, flow.request.host,
                                                                                    flow.request.port):
                reason = self._elsewhere(run, flow.request)
                self._refuse(flow, reason)
                flow.metadata["stepmill_refused"] = reason  # kept once its body is read (``request``)
        except Exception:
            hook_failed("requestheaders")

    def request(self, flow: http.HTTPFlow):
        try:
            refused = flow.metadata.pop("stepmill_refused", None)
            if refused is not None:
                return self._keep_refused(flow, refused)
            if flow.response is not None:
                return
            request = flow.request
            tagged = tagging.split_tag_path(request.path)
            path = tagged[1] if tagged else request.path
            token = request.headers.get(TOKEN_HEADER)
            if token is not None:
                del request.headers[TOKEN_HEADER]  # never sent on
            vouched = bool(token) and _same(token, self._write_token())
            flow.metadata["stepmill_vouched"] = vouched  # while sandboxed runs are open, a call from no door needs it
            if is_admin_route(path) and not vouched:
                return self._refuse(flow, "an engine's admin routes are not reachable through stepmill's proxy")
            door = flow.metadata.get("stepmill_door")  # set by requestheaders: a flow from no door costs no lookup
            run = self.state.runs.runs.get(door) if door is not None else None
            if run is not None and not self._is_control(flow) and not self._reaches(run, request.host, request.port):
                self._refuse(flow, self._elsewhere(run, request))  # an addon before this one sent it elsewhere
        except Exception:
            hook_failed("request")

    # -- CONNECT: the same check, before anything is connected ----------------------------------------
    def http_connect(self, flow: http.HTTPFlow):
        try:
            run = self._door_run(flow)
            if run is not None and not self._reaches(run, flow.request.host, flow.request.port):
                self._refuse(flow, self._elsewhere(run, flow.request))  # answered alike, open port or not
        except Exception:
            hook_failed("http_connect")

    def server_connect(self, data: server_hooks.ServerConnectionHookData):
        """Whatever rewrote a request after the checks above, a door's connection opens to its run's
        hosts alone."""
        try:
            run = self.state.runs.at_door(data.client.id)
            if run is None or data.server.address is None or self._reaches(run, *data.server.address):
                return
            data.server.error = (f"stepmill refused this connection: run {run.trajectory_id!r} reaches only its "
                                 f"LLM through the proxy (the hosts of its route and [isolation] allow_hosts)")
            log.warning(f"stepmill: refused a connection of run {run.trajectory_id!r} to {data.server.address}")
        except Exception:
            hook_failed("server_connect")

    def tcp_start(self, flow: tcp.TCPFlow):
        self._no_raw(flow)

    def udp_start(self, flow: udp.UDPFlow):
        self._no_raw(flow)

    def _no_raw(self, flow) -> None:
        """A run's door carries HTTP to the proxy, never a raw stream to whatever host it names."""
        if self.state.runs.at_door(flow.client_conn.id) is not None:
            log.warning(f"stepmill: refused a raw {type(flow).__name__} from a run's door to {flow.server_conn.address}")
            flow.kill()

    def _keep_refused(self, flow: http.HTTPFlow, reason: str) -> None:
        """An LLM-shaped call (an LLM path, POST or a WebSocket upgrade) refused for where it went: one
        error step with its bytes and the reason, on the refused channel (nothing else is kept)."""
        request = flow.request
        tagged = tagging.split_tag_path(request.path)
        path = (tagged[1] if tagged else request.path).split("?", 1)[0]
        protocol = match(path)
        upgrade = request.method == "GET" and request.headers.get("upgrade", "").lower() == "websocket"
        if protocol is None or not (request.method == "POST" or upgrade):
            return
        call = Call(api=protocol.api, host=request.host, path=path, tags=tagging.Tags(channel=REFUSED_CHANNEL),
                    client_conn=flow.client_conn.id, default_channel=REFUSED_CHANNEL)
        record = CallRecord(kind="failure", call=call, started=request.timestamp_start or time.time(),
                            ended=time.time(), error=f"stepmill refused this call: {reason}", http_status=403,
                            request_encoding=request.headers.get("content-encoding"), keep_raw=True,
                            max_body=ctx.options.stepmill_max_body)
        self.state.began(None)  # handed off at once: settled there
        self.state.hand_off(record, [request.raw_content or b"", flow.response.content or b""])

    # -- the check itself -----------------------------------------------------------------------------
    @staticmethod
    def _reaches(run: RegisteredRun, host: str, port: int) -> bool:
        return destination(host, port) in run.reach

    @staticmethod
    def _elsewhere(run: RegisteredRun, request: http.Request) -> str:
        target = f"[{request.host}]:{request.port}" if ":" in request.host else f"{request.host}:{request.port}"
        return (f"run {run.trajectory_id!r} reaches only its LLM through the proxy (the hosts of its route and "
                f"[isolation] allow_hosts), not {request.method} {target}")

    @staticmethod
    def _is_control(flow: http.HTTPFlow) -> bool:
        """The control API, answered by the proxy itself (ControlEndpoint): no connection goes anywhere."""
        return (isinstance(flow.client_conn.proxy_mode, mode_specs.RegularMode) and flow.request.scheme == "http"
                and flow.request.host == ctx.options.stepmill_control_host)

    @staticmethod
    def _refuse(flow: http.HTTPFlow, reason: str) -> None:
        log.warning(f"stepmill: refused {flow.request.method} {flow.request.host}:{flow.request.port}"
                    f"{flow.request.path[:200] if flow.request.method != 'CONNECT' else ''}: {reason}")
        flow.request.stream = False  # answered here: the body is read and dropped, never streamed on
        flow.response = http.Response.make(403, json_bytes({"error": {
            "message": f"stepmill refused this call: {reason}", "type": "stepmill_refused"}}),
            {"Content-Type": "application/json"})


def _same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.strip().encode(), token.encode())
