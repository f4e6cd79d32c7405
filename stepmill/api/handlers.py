"""The control API's endpoints: each checks its body, calls the store's methods and says what it did.

Run in the proxy's control thread, one call at a time, never on the event loop. Each answers
``(status, body)``; what goes wrong is raised as one of ``stepmill.errors`` and answered with its
status by ``ControlAPI.handle``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Callable

from stepmill import __version__
from stepmill import tags as tagging
from stepmill.api.checks import (
    FEEDBACK_FIELDS,
    NUMBER,
    REVIEW_FIELDS,
    REWARD_FIELDS,
    STEP_FIELDS,
    TRAJECTORY_FIELDS,
    VERSION,
    check,
    is_text,
    json_object,
)
from stepmill.auth.runs import RegisteredRun
from stepmill.auth.secret_hashes import new_secret, secret_hash
from stepmill.errors import BadInput, NotFound, StepmillError, StoreUnavailable
from stepmill.pipeline.journal import stats_with_backlog
from stepmill.store import Store
from stepmill.store.ids import now_iso
from stepmill.store.records import StepRecord

THUMBS = {"up": 1.0, "down": -1.0}  # feedback thumbs as rewards (README: Curation)


def _is_door(value) -> bool:
    """A sandboxed run's door: the SHA-256 of its door key, which the runner's side of the door adds."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


DOOR = (_is_door, "the SHA-256 (64 hex digits) of the run's door key")
HOSTS = (lambda v: isinstance(v, list) and len(v) <= 100 and all(isinstance(h, str) and 0 < len(h) < 300 and is_text(h)
                                                                  for h in v), "a list of host[:port] strings")


class ApiError(StepmillError):
    """An answer no error kind names (a 503 while a trajectory's calls are still being written)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Endpoints:
    """Where agents reach the proxy, for the URLs a new trajectory is given."""

    proxy: str | None = None  # http://host:port of a regular-mode listener
    reverse: str | None = None  # http://host:port of a reverse-mode listener


def with_urls(trajectory: dict, ends: Endpoints, secret: str | None = None) -> dict:
    """A trajectory as answered: with the proxy URL and base URL that tag an agent's calls with it."""
    tid, gid = trajectory["id"], trajectory.get("group_id")
    out = {**trajectory, "trajectory_id": tid}
    if ends.proxy:
        scheme, _, hostport = ends.proxy.partition("://")
        out["proxy_url"] = f"{scheme}://{tagging.credentials(tid, gid, secret)}@{hostport}"
    if ends.reverse:
        out["base_url"] = ends.reverse + tagging.tag_path(tid, gid, secret)
    return out


class Handlers:
    """The endpoints, by the names the route table gives them (``stepmill.api.routes``)."""

    def __init__(self, store: Store, endpoints: Callable[[], Endpoints] = Endpoints, *,
                 status: Callable[[], dict] = dict, on_run: Callable[[RegisteredRun], None] = lambda run: None):
        """``status``: the capture pipeline's state (its threads, what it could not keep or read, its
        backlog), for health and stats; ``on_run``: told of every registered run, so the proxy checks
        its credentials from the next call."""
        self.store = store
        self.endpoints = endpoints
        self.status = status
        self.on_run = on_run
        self._barrier: dict | None = None  # what the proxy's wait before this call found (set per call)

    @staticmethod
    def _found(lookup: Callable[[str], dict | None], key: str, missing: str) -> dict:
        """What ``lookup(key)`` finds; NotFound with the message ``missing`` when it answers None or NotFound."""
        try:
            found = lookup(key)
        except NotFound:
            found = None
        if found is None:
            raise NotFound(missing)
        return found

    def _trajectory(self, tid: str) -> dict:
        return self._found(self.store.trajectory, tid, f"no trajectory {tid!r}")

    # -- endpoints ----------------------------------------------------------------------
    def health(self, body, authorized: bool = False):
        """``ok`` is false while a background thread of the capture (handoff, writer, state watch) is dead:
        a monitor that reads only ``ok`` notices too."""
        capture = self.status()
        ok = bool(capture.get("alive", True))
        if not authorized:
            return 200, {"ok": ok}  # anonymous callers (agents among them) learn nothing else
        return 200, {"ok": ok, "version": __version__, "db": self.store.path,
                     "schema_version": self.store.schema_version, "time": now_iso(), "capture": capture}

    def stats(self, body):
        return 200, {**stats_with_backlog(self.store), "capture": self.status()}

    def get_policy_version(self, body):
        return 200, {"policy_version": self.store.policy_version()}

    def set_policy_version(self, body):
        data = check(json_object(body), {"policy_version": VERSION, "since": NUMBER}, required=("policy_version",))
        since = data.get("since")
        if since is not None and since > time.time():
            raise BadInput("field 'since' is a time already past (epoch seconds): calls are stamped by when they started")
        self.store.set_policy_version(data["policy_version"], since=since)
        return 200, {"policy_version": self.store.policy_version()}

    def start_trajectory(self, body):
        data = check(json_object(body), TRAJECTORY_FIELDS)
        scoring = data.pop("scoring", None)
        trajectory = self.store.start_trajectory(**data)  # Conflict when the id is taken
        if scoring is not None:
            self.store.set_scoring_fields(trajectory["id"], scoring)
        return 201, with_urls(trajectory, self.endpoints())

    def get_trajectory(self, body, tid):
        return 200, with_urls(self._trajectory(tid), self.endpoints())

    def update_trajectory(self, body, tid):
        data = check(json_object(body), {k: v for k, v in TRAJECTORY_FIELDS.items() if k != "trajectory_id"})
        self._trajectory(tid)
        scoring = data.pop("scoring", None)
        if scoring is not None:
            self.store.set_scoring_fields(tid, scoring)
        return 200, with_urls(self.store.update_trajectory(tid, **data), self.endpoints())

    def complete_trajectory(self, body, tid):
        data = check(json_object(body), {"reward": NUMBER})
        self._trajectory(tid)
        if self._barrier is not None and not self._barrier.get("committed"):
            raise ApiError(503, f"calls of trajectory {tid!r} are not committed yet ({self._barrier}); it stays "
                                "open: complete it again")
        self._revoke(tid)  # a completed run writes nothing more, whoever completes it
        completed = with_urls(self.store.complete_trajectory(tid, reward=data.get("reward")), self.endpoints())
        return 200, {**completed, **({"barrier": self._barrier} if self._barrier is not None else {})}

    def register_run(self, body, tid):
        """A fresh secret for the trajectory's run: from now on only credentials with it write to the
        trajectory (a rerun's registration replaces the old secret). The secret is answered once."""
        data = check(json_object(body), {"door": DOOR, "hosts": HOSTS})
        secret = new_secret()
        try:
            row = self.store.register_run(tid, secret_hash(secret), door=data.get("door"), hosts=data.get("hosts"))
        except NotFound:
            raise NotFound(f"no trajectory {tid!r}") from None
        self.on_run(RegisteredRun(tid, row["group_id"], row["channel"], row["secret_hash"], row["rowid"],
                                  door=row["door"], hosts=tuple(row["hosts"])))
        return 201, {**with_urls(self._trajectory(tid), self.endpoints(), secret), "secret": secret}

    def revoke_run(self, body, tid):
        """The run ended: its secret writes nothing from the next call on (every worker is told first)."""
        check(json_object(body), {})
        self._trajectory(tid)
        row = self._revoke(tid)
        if row is None:
            raise NotFound(f"trajectory {tid!r} is not a registered run")
        return 200, {"trajectory_id": tid, "revoked_at": row["revoked_at"]}

    def _revoke(self, tid: str) -> dict | None:
        unrecorded = None
        try:
            row = self.store.revoke_run(tid)
        except StoreUnavailable as exc:
            # The file cannot be written (a full disk): the secret stops working in every worker now all
            # the same; the revocation is recorded when asked again.
            unrecorded, row = exc, self.store.latest_run(tid)
        if row is not None:
            self.on_run(RegisteredRun(tid, row["group_id"], row["channel"], row["secret_hash"], row["rowid"],
                                      revoked=True, door=row.get("door")))
        if unrecorded is not None:
            raise ApiError(503, f"run {tid!r} is revoked in the proxy but not recorded: {unrecorded}") from unrecorded
        return row

    def barrier(self, body):
        """Answered once every call the proxy had received when it arrived is committed."""
        check(json_object(body), {})
        return 200, self._barrier or {"committed": False}

    def submit_step(self, body):
        data = check(json_object(body), STEP_FIELDS, required=("prompt_ids", "response_ids"))
        if data.get("logprobs") is not None and len(data["logprobs"]) != len(data["response_ids"]):
            raise BadInput(f"logprobs has {len(data['logprobs'])} values for {len(data['response_ids'])} response_ids")
        parent = data.get("parent_step_id")
        if parent is not None:
            owner = self.store.trajectory_of_step(parent)
            if owner is None:
                raise BadInput(f"parent_step_id {parent!r} is not a recorded step")
            if data.get("trajectory_id") and owner != data["trajectory_id"]:
                raise BadInput(f"parent_step_id {parent!r} belongs to another trajectory")
            data.setdefault("trajectory_id", owner)
        elif data.get("trajectory_id") and "parent_step_id" not in data:
            # White-box agents submit turns in order: by default a step continues the latest one
            # (an explicit "parent_step_id": null starts the trajectory afresh: a root).
            parent = self.store.last_step(data["trajectory_id"])
        version, started = data.get("policy_version"), data.get("started_at")
        if started is not None and started > time.time():
            raise BadInput("field 'started_at' is a time already past (epoch seconds)")
        if version is None:  # the version whose weights the engine served when the generation began
            version = self.store.policy_version() if started is None else self.store.policy_version_at(started)
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
        return 201, self.store.step_summary(step_id)

    def get_step(self, body, sid):
        return 200, self._found(self.store.step, sid, f"not found: {sid}")

    # -- curation -------------------------------------------------------------------------
    def add_reward(self, body):
        data = check(json_object(body), REWARD_FIELDS, required=("target", "value"))
        return self._reward(data["target"], data["value"], source=data.get("source") or "api", name=data.get("name"),
                            note=data.get("note"), details=data.get("details"),
                            idempotency_key=data.get("idempotency_key"))

    def feedback(self, body):
        """End users' feedback from an app: on a response, step or trajectory id; a human reward."""
        data = check(json_object(body), FEEDBACK_FIELDS)
        targets = [data[k] for k in ("response_id", "step_id", "trajectory_id") if data.get(k)]
        if len(targets) != 1:
            raise BadInput("give exactly one of response_id, step_id, trajectory_id")
        if (data.get("score") is None) == (data.get("thumbs") is None):
            raise BadInput('give exactly one of score, thumbs ("up" / "down")')
        value = data["score"] if data.get("score") is not None else THUMBS[data["thumbs"]]
        key = data.get("idempotency_key") or "feedback:" + hashlib.sha256(json.dumps(
            [targets[0], data.get("score"), data.get("thumbs"), data.get("comment")]).encode()).hexdigest()[:32]
        return self._reward(targets[0], value, source="human", name="feedback", note=data.get("comment"),
                            details={k: data[k] for k in ("thumbs", "score") if data.get(k) is not None},
                            idempotency_key=key)

    def _reward(self, target: str, value: float, **fields):
        try:
            row = self.store.add_reward(target, value, **fields)
        except NotFound:
            raise NotFound(f"no step, trajectory or upstream response {target!r}") from None
        return (201 if row.pop("new") else 200), row

    def add_review(self, body):
        data = check(json_object(body), REVIEW_FIELDS, required=("target", "action", "reviewer"))
        try:
            return 201, self.store.add_review(data["target"], data["action"], data.get("value"),
                                              reviewer=data["reviewer"])
        except NotFound:
            raise NotFound(f"no step or trajectory {data['target']!r}") from None

    def get_curation(self, body, target):
        try:
            return 200, self.store.curation(target)
        except NotFound:
            raise NotFound(f"no step, trajectory or upstream response {target!r}") from None
