"""Rewards, reviews and the curation gate: what people and functions decide about steps.

Both tables are append-only; what holds now is derived from them:

- **Effective reward** of a target (a step or a trajectory): its latest ``human`` reward if it has
  one, else its latest reward from any other source (``env``, ``api``, ``rule``, ``model``). A
  step without one of its own takes its trajectory's. The ``reward`` columns of ``steps`` and
  ``trajectories`` hold the effective value, updated in the transaction that appends a row.
- **Review state**: the latest ``label`` (good | bad | needs-fix) and ``trainable`` (true | false)
  review of a target.
- **The gate** (``gate_reasons``): a step is out of training data when it or its trajectory is
  labelled bad (rejected) or needs-fix, or is marked untrainable. Exports and the trainer bridge
  read through it.
"""

from __future__ import annotations

import sqlite3
from typing import Any

SOURCES = ("rule", "model", "human", "env", "api")
LABELS = ("good", "bad", "needs-fix")
KINDS = ("step", "trajectory")


class UnknownTarget(KeyError):
    """No step, trajectory or upstream response has this id."""


def resolve_target(conn: sqlite3.Connection, target: str) -> tuple[str, str]:
    """(kind, id) of a step id, a trajectory id, or an upstream response id (chatcmpl-…, msg_…, resp_…)."""
    if conn.execute("SELECT 1 FROM steps WHERE id = ?", [target]).fetchone():
        return "step", target
    if conn.execute("SELECT 1 FROM trajectories WHERE id = ?", [target]).fetchone():
        return "trajectory", target
    row = conn.execute("SELECT id FROM steps WHERE response_id = ? ORDER BY rowid DESC LIMIT 1", [target]).fetchone()
    if row:
        return "step", row[0]
    raise UnknownTarget(target)


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
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {source!r}")
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
        raise ValueError(f"a label is one of {', '.join(LABELS)}, not {value!r}")
    if action == "trainable" and value not in ("true", "false"):
        raise ValueError("trainable is 'true' or 'false'")
    if action not in ("label", "trainable", "tag", "note"):
        raise ValueError(f"unknown review action {action!r}")
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
                    " AND rc.created_at > s.started_at) THEN 'an earlier attempt of its run' ")
GATE_REASON = "CASE " + _EARLIER_ATTEMPT + " ".join(
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
