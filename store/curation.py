"""Rewards, reviews and the curation gate: what people and functions decide about steps.

Both tables are append-only; what holds now is derived from them:

- **Effective reward** of a target (a step or a trajectory): its latest ``human`` reward if it has
  one, else its latest reward from any other source (``env``, ``api``, ``rule``, ``model``). A
  step without one of its own takes its trajectory's. The ``reward`` columns of ``steps`` and
  ``trajectories`` hold the effective value, updated in the transaction that appends a row.
- **Review state**: the latest ``label`` (good | bad | needs-fix) and ``trainable`` (true | false)
  review of a target.
- **The gate** (``gate_reasons``): a step is out of training data when it or its trajectory is
  labelled bad (rejected) or needs-fix, or is marked untrainable, when it belongs to an earlier
  attempt of its run, or when its call started after its trajectory was completed. Exports and the trainer bridge
  read through it.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from stepmill.errors import BadInput, NotFound
from stepmill.store.connection import Transactions
from stepmill.store.encoding import dumps
from stepmill.store.ids import now_iso
from stepmill.store.sql_errors import user_condition

SOURCES = ("rule", "model", "human", "env", "api")
LABELS = ("good", "bad", "needs-fix")
KINDS = ("step", "trajectory")


def resolve_target(conn: sqlite3.Connection, target: str) -> tuple[str, str]:
    """(kind, id) of a step id, a trajectory id, or an upstream response id (chatcmpl-…, msg_…, resp_…)."""
    if conn.execute("SELECT 1 FROM steps WHERE id = ?", [target]).fetchone():
        return "step", target
    if conn.execute("SELECT 1 FROM trajectories WHERE id = ?", [target]).fetchone():
        return "trajectory", target
    row = conn.execute("SELECT id FROM steps WHERE response_id = ? ORDER BY rowid DESC LIMIT 1", [target]).fetchone()
    if row:
        return "step", row[0]
    raise NotFound(target)  # no step, trajectory or upstream response has this id


def effective_reward(conn: sqlite3.Connection, kind: str, target_id: str) -> float | None:
    row = conn.execute(
        "SELECT value FROM rewards WHERE target_kind = ? AND target_id = ? AND value IS NOT NULL"
        " ORDER BY source = 'human' DESC, id DESC LIMIT 1", [kind, target_id]).fetchone()
    return row[0] if row else None


def add_reward(conn: sqlite3.Connection, kind: str, target_id: str, value: float | None, *, source: str,
               name: str | None = None, note: str | None = None, details: str | None = None,
               idempotency_key: str | None = None, created_at: str) -> tuple[dict, bool]:
    """Append one reward (in the caller's transaction) and refresh the target's effective reward.
    Returns (the row, whether it is new): a repeated idempotency key returns the first row. A row
    without a value records a reward function that failed (the error in its details)."""
    if source not in SOURCES:
        raise BadInput(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
    if idempotency_key:
        existing = _one(conn, "SELECT * FROM rewards WHERE idempotency_key = ?", [idempotency_key])
        if existing:
            return existing, False
    cursor = conn.execute(
        "INSERT INTO rewards (target_kind, target_id, value, source, name, note, details, idempotency_key, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [kind, target_id, value, source, name, note, details, idempotency_key, created_at])
    table = "steps" if kind == "step" else "trajectories"
    conn.execute(f"UPDATE {table} SET reward = ? WHERE id = ?", [effective_reward(conn, kind, target_id), target_id])
    return _one(conn, "SELECT * FROM rewards WHERE id = ?", [cursor.lastrowid]), True


def add_review(conn: sqlite3.Connection, kind: str, target_id: str, action: str, value: str | None, *,
               reviewer: str, created_at: str) -> dict:
    if action == "label" and value not in LABELS:
        raise BadInput(f"a label is one of {', '.join(LABELS)}, not {value!r}")
    if action == "trainable" and value not in ("true", "false"):
        raise BadInput("trainable is 'true' or 'false'")
    if action not in ("label", "trainable", "tag", "note"):
        raise BadInput(f"unknown review action {action!r}")
    cursor = conn.execute(
        "INSERT INTO reviews (target_kind, target_id, reviewer, action, value, created_at) VALUES (?, ?, ?, ?, ?, ?)",
        [kind, target_id, reviewer, action, value, created_at])
    return _one(conn, "SELECT * FROM reviews WHERE id = ?", [cursor.lastrowid])


def review_state(conn: sqlite3.Connection, kind: str, target_id: str) -> dict:
    state: dict[str, Any] = {"label": None, "trainable": True, "tags": [], "notes": []}
    for action, value in conn.execute(
            "SELECT action, value FROM reviews WHERE target_kind = ? AND target_id = ? ORDER BY id", [kind, target_id]):
        if action == "label":
            state["label"] = value
        elif action == "trainable":
            state["trainable"] = value == "true"
        elif action == "tag":
            state["tags"].append(value)
        elif action == "note":
            state["notes"].append(value)
    return state


# The gate, as SQL over a step row ``s``: the latest label and trainable review of the step and of
# its trajectory, and whether it belongs to an earlier attempt of its run. A step is out when any of
# them says so; the reason names which.
_LATEST = ("(SELECT value FROM reviews r WHERE r.target_kind = '{kind}' AND r.target_id = {id}"
           " AND r.action = '{action}' ORDER BY r.id DESC LIMIT 1)")
# A registered run's trajectory that runs again (a cut-short run resumed) is registered again: its
# steps from before the latest registration are an earlier attempt's, whenever they were committed.
_EARLIER_ATTEMPT = ("WHEN EXISTS (SELECT 1 FROM run_credentials rc WHERE rc.trajectory_id = s.trajectory_id"
                    " AND rc.revoked_at IS NULL AND rc.created_at > s.started_at) THEN 'an earlier attempt of its run' ")
# A call that started after its trajectory was completed was made by something the run left behind,
# whatever let it through: it is not part of what was scored.
_LATE = ("WHEN s.started_at > (SELECT t.completed_at FROM trajectories t WHERE t.id = s.trajectory_id)"
         " THEN 'started after its trajectory completed' ")
GATE_REASON = "CASE " + _EARLIER_ATTEMPT + _LATE + " ".join(
    f"WHEN {_LATEST.format(kind=kind, id=ref, action='label')} = '{label}' THEN '{kind} {reason}' "
    for kind, ref in (("step", "s.id"), ("trajectory", "s.trajectory_id"))
    for label, reason in (("bad", "rejected"), ("needs-fix", "needs a fix"))
) + " ".join(
    f"WHEN {_LATEST.format(kind=kind, id=ref, action='trainable')} = 'false' THEN '{kind} untrainable' "
    for kind, ref in (("step", "s.id"), ("trajectory", "s.trajectory_id"))
) + " END"


def _one(conn: sqlite3.Connection, sql: str, params: list) -> dict | None:
    cursor = conn.execute(sql, params)
    row = cursor.fetchone()
    return None if row is None else dict(zip([d[0] for d in cursor.description], row))


class Curation:
    """Rewards, reviews and the gate over the shared connection, each call one transaction; the
    functions above (of the same names) do the work in it."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def add_reward(self, target: str, value: float, *, source: str = "api", name: str | None = None,
                   note: str | None = None, details: Any = None, idempotency_key: str | None = None) -> dict:
        """Append a reward to a step, a trajectory, or the step of an upstream response id.
        NotFound for an unknown id. The row comes back with ``new`` False for a repeated idempotency key."""
        with self.tx.write() as conn:
            kind, target_id = resolve_target(conn, target)
            row, new = add_reward(conn, kind, target_id, float(value), source=source, name=name, note=note,
                                  details=dumps(details), idempotency_key=idempotency_key, created_at=now_iso())
        return {**row, "new": new}

    def add_trajectory_rewards(self, results: list[tuple[str, float | None, Any]], *, source: str,
                               name: str) -> None:
        """Append (trajectory id, value, details) rewards of one reward function in one transaction; a
        value of None records that the function failed (the error in its details)."""
        with self.tx.write() as conn:
            for trajectory_id, value, details in results:
                add_reward(conn, "trajectory", trajectory_id, value, source=source, name=name,
                           details=dumps(details), created_at=now_iso())

    def rewarded_trajectories(self, name: str) -> set[str]:
        """Ids of the trajectories that have a value from the reward named ``name``."""
        return {row[0] for row in self.tx.conn.execute(
            "SELECT target_id FROM rewards WHERE target_kind = 'trajectory' AND name = ? AND value IS NOT NULL",
            [name])}

    def add_review(self, target: str, action: str, value: str | None = None, *, reviewer: str) -> dict:
        """Append a review action (label, trainable, tag, note) to a step or trajectory. NotFound if unknown."""
        with self.tx.write() as conn:
            kind, target_id = resolve_target(conn, target)
            return add_review(conn, kind, target_id, action, value, reviewer=reviewer, created_at=now_iso())

    def curation(self, target: str) -> dict:
        """A target's reward history, effective reward, review history and current review state."""
        conn = self.tx.conn
        kind, target_id = resolve_target(conn, target)
        return {
            "target_kind": kind, "target_id": target_id,
            "reward": effective_reward(conn, kind, target_id),
            "rewards": self.tx.query("SELECT * FROM rewards WHERE target_kind = ? AND target_id = ? ORDER BY id",
                                     [kind, target_id]),
            "review": review_state(conn, kind, target_id),
            "reviews": self.tx.query("SELECT * FROM reviews WHERE target_kind = ? AND target_id = ? ORDER BY id",
                                     [kind, target_id]),
        }

    def gate_counts(self, where: str | None = None, params: Any = ()) -> dict:
        """How many of the selected steps the curation gate keeps, and why it removes the others."""
        sql = f"SELECT {GATE_REASON} AS reason, count(*) FROM steps s"
        if where:
            sql += f" WHERE ({where})"
        with user_condition(where):
            counts = {reason: n for reason, n in self.tx.conn.execute(sql + " GROUP BY 1", params)}
        kept = counts.pop(None, 0)
        return {"kept": kept, "removed": sum(counts.values()), "removed_by_reason": counts}
