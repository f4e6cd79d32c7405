"""The control API's route table: method and path -> the handler that answers, written once.

Both the answering (``ControlAPI.handle``) and the proxy's wait before a call
(``ControlAPI.barrier_target``) read this table, so a path is matched the same way by both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote

from stepmill.errors import BadInput

EVERY_CALL = "*"  # ``waits_for``: every call the proxy had received before this one


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # "/v1/trajectories/{tid}": a {name} is one path segment, passed to the handler by name
    handler: str  # the ControlAPI method that answers
    public: bool = False  # anonymous callers may call it (and are told less)
    # What the call waits for before it is handled: EVERY_CALL, or the path parameter naming a
    # trajectory whose calls must be committed first; None: nothing.
    waits_for: str | None = None
    pattern: re.Pattern = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "pattern", re.compile(re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.path)))


ROUTES = [
    Route("GET", "/v1/health", "health", public=True),
    Route("GET", "/v1/stats", "stats"),
    Route("GET", "/v1/policy_version", "get_policy_version"),
    Route("PUT", "/v1/policy_version", "set_policy_version"),
    Route("POST", "/v1/policy_version", "set_policy_version"),
    Route("POST", "/v1/trajectories", "start_trajectory"),
    Route("GET", "/v1/trajectories/{tid}", "get_trajectory"),
    Route("PATCH", "/v1/trajectories/{tid}", "update_trajectory"),
    Route("POST", "/v1/trajectories/{tid}/complete", "complete_trajectory", waits_for="tid"),
    Route("POST", "/v1/trajectories/{tid}/credentials", "register_run"),
    Route("DELETE", "/v1/trajectories/{tid}/credentials", "revoke_run"),
    Route("POST", "/v1/barrier", "barrier", waits_for=EVERY_CALL),
    Route("POST", "/v1/steps", "submit_step"),
    Route("GET", "/v1/steps/{sid}", "get_step"),
    Route("POST", "/v1/rewards", "add_reward"),
    Route("POST", "/v1/feedback", "feedback"),
    Route("POST", "/v1/reviews", "add_review"),
    Route("GET", "/v1/curation/{target}", "get_curation"),
]
ENDPOINTS = sorted({route.pattern.pattern for route in ROUTES})  # listed in the answer to an unknown path


def normalize(path: str) -> str:
    """The path without its query string or trailing slash."""
    return path.split("?", 1)[0].rstrip("/") or "/"


@dataclass
class Found:
    route: Route | None  # None: no route for this method (see ``allowed``) or none for this path
    params: dict[str, str]  # the path's parameters, still percent-encoded
    allowed: list[str]  # the methods the path takes, when ``route`` is None

    def decoded(self) -> dict[str, str]:
        """The path parameters decoded; ``BadInput`` when one is not percent-encoded UTF-8."""
        try:
            return {name: unquote(value, errors="strict") for name, value in self.params.items()}
        except UnicodeDecodeError:
            raise BadInput("ids in the path must be percent-encoded UTF-8") from None


def find(method: str, path: str) -> Found:
    """The route for ``method`` on ``path`` (normalized), or the methods the path takes instead."""
    allowed = []
    for route in ROUTES:
        found = route.pattern.fullmatch(path)
        if not found:
            continue
        if route.method != method:
            allowed.append(route.method)
            continue
        return Found(route, found.groupdict(), [])
    return Found(None, {}, allowed)
