"""The control API the running proxy answers: white-box steps, trajectories, policy version, stats.

JSON in, JSON out. Every bad request gets a 4xx with a message; nothing is half-written
because each call is one store transaction.

Agents reach the proxy, so reaching it proves nothing: every endpoint but ``/v1/health`` asks
for the write token (``Authorization: Bearer <token>``), which agents are never given; anonymous
health says only that the proxy is alive.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable
from urllib.parse import unquote

from stepmill import __version__
from stepmill.store.db import Store, StoreError, now_iso
from stepmill.store.records import StepRecord

from stepmill import tags as tagging
from stepmill.auth.runs import Run, new_secret, secret_hash

PUBLIC = {("GET", "/v1/health")}  # what anonymous callers may do
MAX_INT = 2**63 - 1


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


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _object(body: bytes) -> dict:
    if not body:
        return {}
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "body is nested too deeply") from None
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
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and abs(value) < 1e300


def _is_text(value) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def _is_clean(value) -> bool:
    """JSON values SQLite and UTF-8 can hold: text without lone surrogates, integers within 64 bits."""
    if isinstance(value, str):
        return _is_text(value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return -MAX_INT - 1 <= value <= MAX_INT
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_clean(v) for v in value)
    if isinstance(value, dict):
        return all(_is_text(k) and _is_clean(v) for k, v in value.items())
    return False


STRING = (lambda v: isinstance(v, str) and 0 < len(v) <= 200 and _is_text(v), "a non-empty string")
NUMBER = (_is_number, "a number")
OBJECT = (lambda v: isinstance(v, dict) and _is_clean(v), "an object (text without lone surrogates)")
IDS = (_is_ids, "a list of token ids (non-negative integers)")
VERSION = (lambda v: (isinstance(v, str) and 0 < len(v) <= 200 and _is_text(v))
           or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_INT), "a string or an integer")

STEP_FIELDS = {
    "prompt_ids": IDS,
    "response_ids": IDS,
    "logprobs": (lambda v: isinstance(v, list) and all(_is_number(x) for x in v), "a list of numbers"),
    "reward": NUMBER,
    "trajectory_id": STRING,
    "group_id": STRING,
    "parent_step_id": STRING,
    "step_index": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT,
                   "a non-negative integer below 2^63"),
    "policy_version": VERSION,
    "is_last": (lambda v: isinstance(v, bool), "true or false"),
    "metadata": OBJECT,
    "messages": (lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v) and _is_clean(v),
                 "a list of message objects"),
    "completion": OBJECT,
    "model": STRING,
    "channel": STRING,
    "finish_reason": STRING,
}
TEXT = (lambda v: isinstance(v, str) and len(v) <= 10000 and _is_text(v), "a string")
SOURCE = (lambda v: v in ("rule", "model", "human", "env", "api"), "one of rule, model, human, env, api")
THUMBS = {"up": 1.0, "down": -1.0}  # feedback thumbs as rewards (README: Curation)
# ``scoring``: a task's fields for reward functions only (answers, tests), kept apart from the metadata
# every reader sees; written here, never answered.
TRAJECTORY_FIELDS = {"trajectory_id": STRING, "group_id": STRING, "channel": STRING, "metadata": OBJECT,
                     "scoring": OBJECT}


class ControlAPI:
    def __init__(self, store: Store, endpoints: Callable[[], Endpoints] = Endpoints, *, token: str,
                 status: Callable[[], dict] = dict, on_policy_version: Callable[[str | None], None] = lambda v: None,
                 on_run: Callable[[Run], None] = lambda run: None):
        """``status``: the capture pipeline's backlog, for health and stats; ``on_policy_version``: told
        of every new version, so the proxy stamps it without reading the file per step; ``on_run``:
        told of every registered run, so the proxy checks its credentials from the next call."""
        if not token:
            raise ValueError("the control API needs a write token")
        self.store = store
        self.endpoints = endpoints
        self.token = token
        self.status = status
        self.on_policy_version = on_policy_version
        self.on_run = on_run
        self._barrier: dict | None = None  # set per call by handle(); calls are answered one at a time
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
            ("POST", r"/v1/trajectories/(?P<tid>[^/]+)/credentials", self.register_run),
            ("POST", r"/v1/barrier", self.barrier),
            ("POST", r"/v1/steps", self.submit_step),
            ("GET", r"/v1/steps/(?P<sid>[^/]+)", self.get_step),
            ("POST", r"/v1/rewards", self.add_reward),
            ("POST", r"/v1/feedback", self.feedback),
            ("POST", r"/v1/reviews", self.add_review),
            ("GET", r"/v1/curation/(?P<target>[^/]+)", self.get_curation),
        ]

    def authorized(self, authorization: str | None) -> bool:
        scheme, _, value = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def barrier_target(self, method: str, path: str, authorization: str | None):
        """What an authorized call must wait for before it is handled: the trajectory a ``complete``
        names, None (every call) for ``POST /v1/barrier``, or False (nothing)."""
        path = path.split("?", 1)[0].rstrip("/")
        if method != "POST" or not self.authorized(authorization):
            return False
        if path == "/v1/barrier":
            return None
        found = re.fullmatch(r"/v1/trajectories/([^/]+)/complete", path)
        if found:
            try:
                return unquote(found.group(1), errors="strict")
            except UnicodeDecodeError:
                return False
        return False

    def handle(self, method: str, path: str, body: bytes, *, authorization: str | None = None,
               barrier: dict | None = None) -> tuple[int, dict]:
        """``barrier``: what the proxy's wait before this call found (complete and barrier calls)."""
        self._barrier = barrier
        try:
            return self._handle(method, path, body, authorization)
        except Exception as exc:  # a bug answers JSON, never the proxy's 502 page
            return 500, {"error": f"the control API failed: {type(exc).__name__}: {exc}"}

    def _handle(self, method: str, path: str, body: bytes, authorization: str | None) -> tuple[int, dict]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if (method, path) not in PUBLIC and not self.authorized(authorization):
            return 401, {"error": "the control API needs the write token: Authorization: Bearer <token> "
                                  "(STEPMILL_TOKEN, or the stepmill-token file in the proxy's confdir)"}
        allowed = []
        for verb, pattern, handler in self.routes:
            found = re.fullmatch(pattern, path)
            if not found:
                continue
            if verb != method:
                allowed.append(verb)
                continue
            try:
                params = {k: unquote(v, errors="strict") for k, v in found.groupdict().items()}
                if handler == self.health:
                    params["authorized"] = self.authorized(authorization)
                return handler(body=body, **params)
            except UnicodeDecodeError:
                return 400, {"error": "ids in the path must be percent-encoded UTF-8"}
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
    def health(self, body, authorized: bool = False):
        if not authorized:
            return 200, {"ok": True}  # anonymous callers (agents among them) learn nothing else
        return 200, {"ok": True, "version": __version__, "db": self.store.path,
                     "schema_version": self.store.schema_version, "time": now_iso(), "capture": self.status()}

    def stats(self, body):
        return 200, {**self.store.stats(), "capture": self.status()}

    def get_policy_version(self, body):
        return 200, {"policy_version": self.store.policy_version()}

    def set_policy_version(self, body):
        data = _check(_object(body), {"policy_version": VERSION}, required=("policy_version",))
        self.store.set_policy_version(data["policy_version"])
        version = self.store.policy_version()
        self.on_policy_version(version)
        return 200, {"policy_version": version}

    def _with_urls(self, trajectory: dict, secret: str | None = None) -> dict:
        ends = self.endpoints()
        tid, gid = trajectory["id"], trajectory.get("group_id")
        out = {**trajectory, "trajectory_id": tid}
        if ends.proxy:
            scheme, _, hostport = ends.proxy.partition("://")
            out["proxy_url"] = f"{scheme}://{tagging.credentials(tid, gid, secret)}@{hostport}"
        if ends.reverse:
            out["base_url"] = ends.reverse + tagging.tag_path(tid, gid, secret)
        return out

    def start_trajectory(self, body):
        data = _check(_object(body), TRAJECTORY_FIELDS)
        scoring = data.pop("scoring", None)
        trajectory = self.store.start_trajectory(**data)
        if scoring is not None:
            self.store.set_scoring_fields(trajectory["id"], scoring)
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
        if data.get("scoring") is not None:
            self.store.set_scoring_fields(tid, data.pop("scoring"))
        data.pop("scoring", None)
        return 200, self._with_urls(self.store.update_trajectory(tid, **data))

    def complete_trajectory(self, body, tid):
        data = _check(_object(body), {"reward": NUMBER})
        if self.store.trajectory(tid) is None:
            raise ApiError(404, f"no trajectory {tid!r}")
        if self._barrier is not None and not self._barrier.get("committed"):
            raise ApiError(503, f"calls of trajectory {tid!r} are not committed yet ({self._barrier}); it stays "
                                "open: complete it again")
        completed = self._with_urls(self.store.complete_trajectory(tid, reward=data.get("reward")))
        return 200, {**completed, **({"barrier": self._barrier} if self._barrier is not None else {})}

    def register_run(self, body, tid):
        """A fresh secret for the trajectory's run: from now on only credentials with it write to the
        trajectory (a rerun's registration replaces the old secret). The secret is answered once."""
        _check(_object(body), {})
        secret = new_secret()
        try:
            row = self.store.register_run(tid, secret_hash(secret))
        except KeyError:
            raise ApiError(404, f"no trajectory {tid!r}") from None
        self.on_run(Run(tid, row["group_id"], row["channel"], row["secret_hash"], row["rowid"]))
        trajectory = self.store.trajectory(tid)
        return 201, {**self._with_urls(trajectory, secret), "secret": secret}

    def barrier(self, body):
        """Answered once every call the proxy had received when it arrived is committed."""
        _check(_object(body), {})
        return 200, self._barrier or {"committed": False}

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
        elif data.get("trajectory_id") and "parent_step_id" not in data:
            # White-box agents submit turns in order: by default a step continues the latest one
            # (an explicit "parent_step_id": null starts the trajectory afresh: a root).
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
            usage={"input_tokens": len(data["prompt_ids"]), "output_tokens": len(data["response_ids"])},
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

    # -- curation -------------------------------------------------------------------------
    def add_reward(self, body):
        data = _check(_object(body), {"target": STRING, "value": NUMBER, "source": SOURCE, "name": STRING,
                                      "note": TEXT, "details": OBJECT, "idempotency_key": STRING},
                      required=("target", "value"))
        return self._reward(data["target"], data["value"], source=data.get("source") or "api", name=data.get("name"),
                            note=data.get("note"), details=data.get("details"),
                            idempotency_key=data.get("idempotency_key"))

    def feedback(self, body):
        """End users' feedback from an app: on a response, step or trajectory id; a human reward."""
        data = _check(_object(body), {"response_id": STRING, "step_id": STRING, "trajectory_id": STRING,
                                      "score": NUMBER, "thumbs": (lambda v: v in ("up", "down"), '"up" or "down"'),
                                      "comment": TEXT, "idempotency_key": STRING})
        targets = [data[k] for k in ("response_id", "step_id", "trajectory_id") if data.get(k)]
        if len(targets) != 1:
            raise ApiError(400, "give exactly one of response_id, step_id, trajectory_id")
        if (data.get("score") is None) == (data.get("thumbs") is None):
            raise ApiError(400, 'give exactly one of score, thumbs ("up" / "down")')
        value = data["score"] if data.get("score") is not None else THUMBS[data["thumbs"]]
        key = data.get("idempotency_key") or "feedback:" + hashlib.sha256(json.dumps(
            [targets[0], data.get("score"), data.get("thumbs"), data.get("comment")]).encode()).hexdigest()[:32]
        return self._reward(targets[0], value, source="human", name="feedback", note=data.get("comment"),
                            details={k: data[k] for k in ("thumbs", "score") if data.get(k) is not None},
                            idempotency_key=key)

    def _reward(self, target: str, value: float, **fields):
        try:
            row = self.store.add_reward(target, value, **fields)
        except KeyError:
            raise ApiError(404, f"no step, trajectory or upstream response {target!r}") from None
        return (201 if row.pop("new") else 200), row

    def add_review(self, body):
        data = _check(_object(body), {"target": STRING, "action": STRING, "value": TEXT, "reviewer": STRING},
                      required=("target", "action", "reviewer"))
        try:
            return 201, self.store.add_review(data["target"], data["action"], data.get("value"),
                                              reviewer=data["reviewer"])
        except KeyError:
            raise ApiError(404, f"no step or trajectory {data['target']!r}") from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def get_curation(self, body, target):
        try:
            return 200, self.store.curation(target)
        except KeyError:
            raise ApiError(404, f"no step, trajectory or upstream response {target!r}") from None
