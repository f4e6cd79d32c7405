"""The control API the running proxy answers: white-box steps, trajectories, policy version, stats.

JSON in, JSON out. Every bad request gets a 4xx with a message; nothing is half-written
because each call is one store transaction. The routes are in ``routes``, the body checks in
``checks``, the endpoints in ``handlers``; here: who may call, and what each error answers.

Agents reach the proxy, so reaching it proves nothing: every endpoint but ``/v1/health`` asks
for the write token (``Authorization: Bearer <token>``), which agents are never given; anonymous
health says only that the proxy is alive.
"""

from __future__ import annotations

import logging
from typing import Callable

from stepmill.api import routes
from stepmill.api.handlers import ApiError, Endpoints, Handlers
from stepmill.auth.runs import RegisteredRun
from stepmill.auth.write_token import bearer_matches
from stepmill.errors import BadInput, ConfigError, StepmillError
from stepmill.store import Store

log = logging.getLogger("stepmill")

UNAUTHORIZED = ("the control API needs the write token: Authorization: Bearer <token> "
                "(STEPMILL_TOKEN, or the stepmill-token file in the proxy's confdir)")


class ControlAPI(Handlers):
    def __init__(self, store: Store, endpoints: Callable[[], Endpoints] = Endpoints, *, token: str,
                 status: Callable[[], dict] = dict, on_run: Callable[[RegisteredRun], None] = lambda run: None):
        """``token``: what every call but anonymous health must carry; the rest as for ``Handlers``."""
        if not token:
            raise ConfigError("the control API needs a write token")
        super().__init__(store, endpoints, status=status, on_run=on_run)
        self.token = token

    def authorized(self, authorization: str | None) -> bool:
        return bearer_matches(authorization, self.token)

    def barrier_target(self, method: str, path: str, authorization: str | None):
        """What an authorized call must wait for before it is handled: the trajectory a ``complete``
        names, None (every call) for ``POST /v1/barrier``, or False (nothing)."""
        if not self.authorized(authorization):
            return False
        found = routes.find(method, routes.normalize(path))
        waits = found.route.waits_for if found.route is not None else None
        if waits is None:
            return False
        if waits == routes.EVERY_CALL:
            return None
        try:
            return found.decoded()[waits]
        except BadInput:  # answered 400 by handle()
            return False

    def handle(self, method: str, path: str, body: bytes, *, authorization: str | None = None,
               barrier: dict | None = None) -> tuple[int, dict]:
        """``barrier``: what the proxy's wait before this call found (complete and barrier calls)."""
        self._barrier = barrier
        try:
            return self._handle(method, path, body, authorization)
        except StepmillError as exc:  # a kind of error the caller can act on: its status and sentence
            return exc.status, {"error": str(exc)}
        except Exception as exc:  # a bug answers JSON, never the proxy's 502 page
            log.exception("the control API failed on %s %s", method, path)
            return 500, {"error": f"the control API failed: {type(exc).__name__}: {exc}"}

    def _handle(self, method: str, path: str, body: bytes, authorization: str | None) -> tuple[int, dict]:
        path = routes.normalize(path)
        found = routes.find(method, path)
        public = found.route is not None and found.route.public
        if not public and not self.authorized(authorization):
            return 401, {"error": UNAUTHORIZED}
        if found.route is None:
            if found.allowed:
                return 405, {"error": f"{method} not allowed on {path}; use {', '.join(sorted(set(found.allowed)))}"}
            return 404, {"error": f"no control endpoint {path}", "endpoints": routes.ENDPOINTS}
        params = found.decoded()
        if public:
            params["authorized"] = self.authorized(authorization)
        return getattr(self, found.route.handler)(body=body, **params)


__all__ = ["ControlAPI", "Endpoints", "ApiError"]
