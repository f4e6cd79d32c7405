"""The control API the running proxy answers: white-box steps, trajectories, policy version, stats.

JSON in, JSON out. Every bad request gets a 4xx with a message; nothing is half-written
because each call is one store transaction.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable

from stepmill import __version__
from stepmill.store.db import Store, StoreError, now_iso
from stepmill.store.records import StepRecord

PREFIX = "/_stepmill"  # the control API's path when reached on the proxy port itself


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Endpoints:
    """Where agents reach the proxy, for the URLs a new trajectory is given."""

    proxy: str | None = None  # http://host:port of a regular-mode listener
    reverse: str | None = None  # http://host:port of a reverse-mode listener


def _object(body: bytes) -> dict:
    if not body:
        return {}
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "body must be a JSON object")
    return value


def _check(body: dict, spec: dict[str, Callable[[Any], bool] | tuple], required: tuple = ()) -> dict:
    for name in body:
        if name not in spec:
            raise ApiError(400, f"unknown field {name!r}; expected some of: {', '.join(sorted(spec))}")
    for name in required:
        if body.get(name) is None:
            raise ApiError(400, f"field {name!r} is required")
    for name, value in body.items():
        check, what = spec[name]
        if value is not None and not check(value):
            raise ApiError(400, f"field {name!r} must be {what}")
    return body


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in value)


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


STRING = (lambda v: isinstance(v, str) and 0 < len(v) <= 200, "a non-empty string")
NUMBER = (_is_number, "a number")
OBJECT = (lambda v: isinstance(v, dict), "an object")
IDS = (_is_ids, "a list of token ids (non-negative integers)")
VERSION = (lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a string or an integer")

STEP_FIELDS = {
    "prompt_ids": IDS,
    "response_ids": IDS,
    "logprobs": (lambda v: isinstance(v, list) and all(_is_number(x) for x in v), "a list of numbers"),
    "reward": NUMBER,
    "trajectory_id": STRING,
    "group_id": STRING,
    "parent_step_id": STRING,
    "step_index": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    "policy_version": VERSION,
    "is_last": (lambda v: isinstance(v, bool), "true or false"),
    "metadata": OBJECT,
    "messages": (lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v), "a list of message objects"),
    "completion": OBJECT,
    "model": STRING,
    "channel": STRING,
    "finish_reason": STRING,
}
TRAJECTORY_FIELDS = {"trajectory_id": STRING, "group_id": STRING, "channel": STRING, "metadata": OBJECT}


class ControlAPI:
    def __init__(self, store: Store, endpoints: Callable[[], Endpoints] = Endpoints):
        self.store = store
        self.endpoints = endpoints
        self.routes = [
            ("GET", r"/v1/health", self.health),
            ("GET", r"/v1/stats", self.stats),
            ("GET", r"/v1/policy_version", self.get_policy_version),
            ("PUT", r"/v1/policy_version", self.set_policy_version),
            ("POST", r"/v1/policy_version", self.set_policy_version),
            ("POST", r"/v1/trajectories", self.start_trajectory),
            ("GET", r"/v1/trajectories/(?P<tid>[^/]+)", self.get_trajectory),
            ("PATCH", r"/v1/trajectories/(?P<tid>[^/]+)", self.update_trajectory),
            ("POST", r"/v1/trajectories/(?P<tid>[^/]+)/complete", self.complete_trajectory),
            ("POST", r"/v1/steps", self.submit_step),
            ("GET", r"/v1/steps/(?P<sid>[^/]+)", self.get_step),
        ]

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if path.startswith(PREFIX):
            path = path[len(PREFIX):] or "/"
        allowed = []
        for verb, pattern, handler in self.routes:
            found = re.fullmatch(pattern, path)
            if not found:
                continue
            if verb != method:
                allowed.append(verb)
                continue
            try:
                return handler(body=body, **found.groupdict())
            except ApiError as exc:
                return exc.status, {"error": exc.message}
            except KeyError as exc:
                return 404, {"error": f"not found: {exc.args[0]}"}
            except StoreError as exc:
                return 409 if "already exists" in str(exc) else 400, {"error": str(exc)}
        if allowed:
            return 405, {"error": f"{method} not allowed on {path}; use {', '.join(sorted(set(allowed)))}"}
        return 404, {"error": f"no control endpoint {path}", "endpoints": sorted({p for _, p, _ in self.routes})}

    # -- endpoints ----------------------------------------------------------------------
    def health(self, body):
        return 200, {"ok": True, "version": __version__, "db": self.store.path,
                     "schema_version": self.store.schema_version, "time": now_iso()}

    def stats(self, body):
        return 200, self.store.stats()

    def get_policy_version(self, body):
        return 200, {"policy_version": self.store.policy_version()}

    def set_policy_version(self, body):
        data = _check(_object(body), {"policy_version": VERSION}, required=("policy_version",))
        self.store.set_policy_version(data["policy_version"])
        return 200, {"policy_version": self.store.policy_version()}

    def _with_urls(self, trajectory: dict) -> dict:
        ends = self.endpoints()
        tid, gid = trajectory["id"], trajectory.get("group_id")
        tags = f"{tid}:{gid}" if gid else tid
        out = {**trajectory, "trajectory_id": tid}
        if ends.proxy:
            scheme, _, hostport = ends.proxy.partition("://")
            out["proxy_url"] = f"{scheme}://{tags}@{hostport}"
        if ends.reverse:
            out["base_url"] = f"{ends.reverse}/t/{tid}" + (f"/g/{gid}" if gid else "")
        return out

    def start_trajectory(self, body):
        data = _check(_object(body), TRAJECTORY_FIELDS)
        trajectory = self.store.start_trajectory(**data)
        return 201, self._with_urls(trajectory)

    def get_trajectory(self, body, tid):
        trajectory = self.store.trajectory(tid)
        if trajectory is None:
            raise ApiError(404, f"no trajectory {tid!r}")
        return 200, self._with_urls(trajectory)

    def update_trajectory(self, body, tid):
        data = _check(_object(body), {k: v for k, v in TRAJECTORY_FIELDS.items() if k != "trajectory_id"})
        if self.store.trajectory(tid) is None:
            raise ApiError(404, f"no trajectory {tid!r}")
        return 200, self._with_urls(self.store.update_trajectory(tid, **data))

    def complete_trajectory(self, body, tid):
        data = _check(_object(body), {"reward": NUMBER})
        if self.store.trajectory(tid) is None:
            raise ApiError(404, f"no trajectory {tid!r}")
        return 200, self._with_urls(self.store.complete_trajectory(tid, reward=data.get("reward")))

    def submit_step(self, body):
        data = _check(_object(body), STEP_FIELDS, required=("prompt_ids", "response_ids"))
        if data.get("logprobs") is not None and len(data["logprobs"]) != len(data["response_ids"]):
            raise ApiError(400, f"logprobs has {len(data['logprobs'])} values for {len(data['response_ids'])} response_ids")
        parent = data.get("parent_step_id")
        if parent is not None:
            rows = self.store.query("SELECT trajectory_id FROM steps WHERE id = ?", [parent])
            if not rows:
                raise ApiError(400, f"parent_step_id {parent!r} is not a recorded step")
            if data.get("trajectory_id") and rows[0]["trajectory_id"] != data["trajectory_id"]:
                raise ApiError(400, f"parent_step_id {parent!r} belongs to another trajectory")
            data.setdefault("trajectory_id", rows[0]["trajectory_id"])
        elif data.get("trajectory_id"):
            # White-box agents submit turns in order: by default a step continues the latest one.
            rows = self.store.query(
                "SELECT id FROM steps WHERE trajectory_id = ? ORDER BY step_index DESC, rowid DESC LIMIT 1",
                [data["trajectory_id"]])
            parent = rows[0]["id"] if rows else None
        version = data.get("policy_version")
        if version is None:
            version = self.store.policy_version()
        record = StepRecord(
            api="control",
            transport="http",
            model=data.get("model"),
            messages=data.get("messages") or [],
            completion=data.get("completion"),
            finish_reason=data.get("finish_reason"),
            trajectory_id=data.get("trajectory_id"),
            group_id=data.get("group_id"),
            parent_step_id=parent,
            step_index=data.get("step_index"),
            channel=data.get("channel"),
            policy_version=None if version is None else str(version),
            reward=data.get("reward"),
            metadata=data.get("metadata"),
            prompt_ids=data["prompt_ids"],
            response_ids=data["response_ids"],
            logprobs=data.get("logprobs"),
            token_provenance="exact",
            is_last=bool(data.get("is_last")),
        )
        step_id = self.store.record_step(record)
        row = self.store.query(
            "SELECT id AS step_id, trajectory_id, group_id, parent_step_id, step_index, consistency,"
            " divergence_pos, divergence_reason FROM steps WHERE id = ?", [step_id])[0]
        return 201, row

    def get_step(self, body, sid):
        return 200, self.store.step(sid)
