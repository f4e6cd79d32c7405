"""On the event loop: what a call may reach, by where it comes from.

- Every caller: an engine's admin routes (``stepmill.auth.admin_routes``: weights, caches, RPC into
  its workers) are refused through the proxy unless the request carries the write token in
  ``X-Stepmill-Token`` (the trainer calls its engine directly anyway).
- A sandboxed run's door (a connection from the loopback address registered with the run, see
  ``stepmill.runner.door``): once its run has ended, nothing; while it runs, LLM calls (which
  ``HttpCapture`` records as that run's, whatever they name) and requests to the hosts registered
  with it (the configured LLM's, ``[isolation] allow_hosts``). Nothing else: no other host, no raw
  TCP or UDP after a CONNECT.

It comes before the control endpoint and the capture, so what it refuses never reaches them.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx, http, tcp, udp

from stepmill import tags as tagging
from stepmill.addon.loop_state import LoopState, hook_failed
from stepmill.auth.admin_routes import is_admin_route
from stepmill.auth.write_token import ensure_token
from stepmill.protocols import match
from stepmill.protocols.base import json_bytes

log = logging.getLogger("stepmill")
TOKEN_HEADER = "X-Stepmill-Token"


def client_address(flow) -> str | None:
    peer = flow.client_conn.peername
    return peer[0] if peer else None


class Doors:
    def __init__(self, state: LoopState):
        self.state = state
        self._token: str | None = None

    def _write_token(self) -> str:
        if self._token is None:
            self._token = ensure_token(ctx.options.confdir)
        return self._token

    def request(self, flow: http.HTTPFlow):
        try:
            if flow.response is not None:
                return
            request = flow.request
            tagged = tagging.split_tag_path(request.path)
            path = tagged[1] if tagged else request.path
            token = request.headers.get(TOKEN_HEADER)
            if token is not None:
                del request.headers[TOKEN_HEADER]  # never sent on
            run = self.state.runs.at_door(client_address(flow))
            if run is not None:
                flow.metadata["stepmill_door"] = run.trajectory_id
            vouched = bool(token) and _same(token, self._write_token())
            flow.metadata["stepmill_vouched"] = vouched  # while sandboxed runs are open, a call from no door needs it
            if is_admin_route(path) and not vouched:
                return self._refuse(flow, "an engine's admin routes are not reachable through stepmill's proxy")
            if run is None or self._is_control(flow):
                return
            if run.revoked:
                return self._refuse(flow, f"run {run.trajectory_id!r} has ended: its credentials were revoked")
            host = f"{request.pretty_host}:{request.port}"
            if host in run.hosts or request.pretty_host in run.hosts:
                return
            websocket = request.method == "GET" and request.headers.get("upgrade", "").lower() == "websocket"
            if match(path) is not None and (request.method == "POST" or websocket):
                return  # an LLM call: HttpCapture records it as the run's
            return self._refuse(flow, f"run {run.trajectory_id!r} reaches only its LLM through the proxy, not "
                                      f"{request.method} {host}{path.split('?', 1)[0]} ([isolation] allow_hosts)")
        except Exception:
            hook_failed("request")

    @staticmethod
    def _is_control(flow: http.HTTPFlow) -> bool:
        return flow.request.scheme == "http" and flow.request.host == ctx.options.stepmill_control_host

    @staticmethod
    def _refuse(flow: http.HTTPFlow, reason: str) -> None:
        log.warning(f"stepmill: refused {flow.request.method} {flow.request.pretty_host}{flow.request.path[:200]}: "
                    f"{reason}")
        flow.response = http.Response.make(403, json_bytes({"error": {
            "message": f"stepmill refused this call: {reason}", "type": "stepmill_refused"}}),
            {"Content-Type": "application/json"})

    def tcp_start(self, flow: tcp.TCPFlow):
        self._no_raw(flow)

    def udp_start(self, flow: udp.UDPFlow):
        self._no_raw(flow)

    def _no_raw(self, flow) -> None:
        """A run's door carries HTTP to the proxy, never a raw stream to whatever host it names."""
        if self.state.runs.at_door(client_address(flow)) is not None:
            log.warning(f"stepmill: refused a raw {type(flow).__name__} from a run's door to {flow.server_conn.address}")
            flow.kill()


def _same(given: str, token: str) -> bool:
    import hmac

    return hmac.compare_digest(given.strip().encode(), token.encode())
