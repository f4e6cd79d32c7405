"""Which trajectory, parent and group a new step belongs to.

A call continues the step whose conversation plus completion its own conversation starts with.
Keys are looked up newest first through indexes and a bounded number of candidates, so the
cost stays flat as the file grows, also when thousands of steps share a prefix (GRPO groups,
replays). Among equal candidates a parent nobody continued yet wins, then one on the same
client connection: n concurrent rollouts of one prompt stay n trajectories.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from stepmill.errors import BadInput
from stepmill.store.records import StepRecord

CANDIDATES = 64  # newest steps considered per key


@dataclass
class Parent:
    id: str
    trajectory_id: str
    system_hash: str | None = None
    loose: bool = False  # found with system messages left out of the keys


def _best(conn: sqlite3.Connection, column: str, key: str, trajectory_id: str | None,
          client_conn: str | None) -> Parent | None:
    sql = f"SELECT id, trajectory_id, client_conn, system_hash FROM steps WHERE {column} = ?"
    params: list = [key]
    if trajectory_id is not None:
        sql += " AND trajectory_id = ?"
        params.append(trajectory_id)
    sql += f" ORDER BY rowid DESC LIMIT {CANDIDATES}"
    rows = conn.execute(sql, params).fetchall()
    if not rows:
        return None
    if len(rows) == 1:
        best = rows[0]
    else:
        continued = {row[0] for row in conn.execute(
            f"SELECT DISTINCT parent_step_id FROM steps WHERE parent_step_id IN ({','.join('?' * len(rows))})",
            [r[0] for r in rows])}
        # rows are newest first; max() keeps the first of equals
        best = max(rows, key=lambda r: (r[0] not in continued, client_conn is not None and r[2] == client_conn))
    return Parent(best[0], best[1], best[3])


def find_parent(conn: sqlite3.Connection, rec: StepRecord, trajectory_id: str | None, keys: list[str],
                loose_keys: list[str]) -> Parent | None:
    """The step ``rec`` continues. ``keys[k]`` identifies its messages[:k+1]; ``loose_keys`` the same
    without system messages, tried when no exact match exists (a system prompt that changes per call)."""
    if rec.parent_step_id:
        row = conn.execute("SELECT trajectory_id, system_hash FROM steps WHERE id = ?", [rec.parent_step_id]).fetchone()
        if row is None:
            raise BadInput(f"parent step {rec.parent_step_id!r} does not exist")
        return Parent(rec.parent_step_id, row[0], row[1])
    if rec.previous_response_id:
        row = conn.execute(
            "SELECT id, trajectory_id, system_hash FROM steps WHERE response_id = ? ORDER BY rowid DESC LIMIT 1",
            [rec.previous_response_id],
        ).fetchone()
        if row:
            return Parent(row[0], row[1], row[2])
    for column, candidates, loose in (("continuation_key", keys, False), ("loose_key", loose_keys, True)):
        for key in reversed(candidates):  # the longest history first
            parent = _best(conn, column, key, trajectory_id, rec.client_conn)
            if parent is not None:
                parent.loose = loose
                return parent
    return None


def ensure_trajectory(conn: sqlite3.Connection, trajectory_id: str, *, group_id=None, channel=None,
                      default_channel=None, source=None, metadata=None, policy_version=None, created_at: str,
                      minted: bool = False) -> dict:
    """The trajectory's row, created if new. A trajectory's group and channel hold for all its steps:
    an explicit group replaces an automatic one (``g-…``), an explicit channel replaces the current
    one, and the steps already recorded follow. ``minted``: an id made just now, which no row has."""
    row = None if minted else conn.execute("SELECT group_id, channel, status FROM trajectories WHERE id = ?",
                                           [trajectory_id]).fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO trajectories (id, group_id, channel, source, status, metadata, policy_version, created_at)"
            " VALUES (?, ?, ?, ?, 'open', ?, ?, ?)",
            [trajectory_id, group_id, channel or default_channel or "train", source, metadata, policy_version,
             created_at],
        )
        return {"group_id": group_id, "channel": channel or default_channel or "train", "status": "open"}
    current = {"group_id": row[0], "channel": row[1], "status": row[2]}
    changes = {}
    if group_id and group_id != current["group_id"] and (current["group_id"] or "g-").startswith("g-") \
            and not group_id.startswith("g-"):
        changes["group_id"] = group_id
    if channel and channel != current["channel"]:
        changes["channel"] = channel
    if changes:
        set_trajectory_fields(conn, trajectory_id, changes)
        current.update(changes)
    return current


def set_trajectory_fields(conn: sqlite3.Connection, trajectory_id: str, fields: dict) -> None:
    """Group or channel of a trajectory and of all its steps, together."""
    assignments = ", ".join(f"{name} = ?" for name in fields)
    conn.execute(f"UPDATE trajectories SET {assignments} WHERE id = ?", [*fields.values(), trajectory_id])
    conn.execute(f"UPDATE steps SET {assignments} WHERE trajectory_id = ?", [*fields.values(), trajectory_id])
