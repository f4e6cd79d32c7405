"""Trajectories and their groups, and each task's scoring fields."""

from __future__ import annotations

from typing import Any

from stepmill.errors import Conflict, NotFound
from stepmill.store import curation
from stepmill.store.assign import ensure_trajectory, set_trajectory_fields
from stepmill.store.connection import Transactions
from stepmill.store.encoding import dumps, loads
from stepmill.store.ids import new_id, now_iso
from stepmill.store.sql_errors import UserParameters, user_condition
from stepmill.store.state import State


class Trajectories:
    """Start, change, complete and read trajectories (stamped with ``state``'s policy version)."""

    def __init__(self, tx: Transactions, state: State):
        self.tx = tx
        self.state = state

    def trajectory(self, trajectory_id: str) -> dict | None:
        rows = self.tx.query("SELECT * FROM trajectories WHERE id = ?", [trajectory_id])
        if not rows:
            return None
        row = rows[0]
        row["metadata"] = loads(row["metadata"])
        row["step_count"] = self.tx.conn.execute(
            "SELECT count(*) FROM steps WHERE trajectory_id = ?", [trajectory_id]
        ).fetchone()[0]
        return row

    def start_trajectory(self, *, trajectory_id=None, group_id=None, channel=None, metadata=None) -> dict:
        trajectory_id = trajectory_id or new_id("t")
        with self.tx.write() as conn:
            if conn.execute("SELECT 1 FROM trajectories WHERE id = ?", [trajectory_id]).fetchone():
                raise Conflict(f"trajectory {trajectory_id!r} already exists")
            ensure_trajectory(conn, trajectory_id, group_id=group_id, channel=channel, source="api",
                              metadata=dumps(metadata), policy_version=self.state.policy_version(),
                              created_at=now_iso())
        return self.trajectory(trajectory_id)

    def update_trajectory(self, trajectory_id: str, *, group_id=None, channel=None, metadata=None) -> dict:
        with self.tx.write() as conn:
            row = conn.execute("SELECT metadata FROM trajectories WHERE id = ?", [trajectory_id]).fetchone()
            if row is None:
                raise NotFound(trajectory_id)
            fields = {k: v for k, v in (("group_id", group_id), ("channel", channel)) if v is not None}
            if fields:
                set_trajectory_fields(conn, trajectory_id, fields)
            if metadata is not None:
                merged = {**(loads(row[0]) or {}), **metadata}
                conn.execute("UPDATE trajectories SET metadata = ? WHERE id = ?", [dumps(merged), trajectory_id])
        return self.trajectory(trajectory_id)

    def complete_trajectory(self, trajectory_id: str, *, reward: float | None = None) -> dict:
        with self.tx.write() as conn:
            if not conn.execute("SELECT 1 FROM trajectories WHERE id = ?", [trajectory_id]).fetchone():
                raise NotFound(trajectory_id)
            conn.execute("UPDATE trajectories SET status = 'complete', completed_at = ? WHERE id = ?",
                         [now_iso(), trajectory_id])
            if reward is not None:
                curation.add_reward(conn, "trajectory", trajectory_id, reward, source="api", name="control API",
                                    created_at=now_iso())
        return self.trajectory(trajectory_id)

    def completed_trajectories(self, where: str | None = None, params: Any = (), *,
                               id_prefix: str | None = None, group_id: str | None = None) -> list[dict]:
        """Rows of the completed trajectories, oldest first (``metadata`` decoded).
        ``where``: a user's SQL condition on the trajectories table (alias t); ``id_prefix``: only ids
        that start with it (one rollout's runs); ``group_id``: one group's."""
        condition = "t.status = 'complete'" + (f" AND ({where})" if where else "")
        if group_id is not None:
            bound = UserParameters(params)
            condition += f" AND t.group_id = {bound.bind('_group', group_id)}"
            params = bound.values
        with user_condition(where):
            rows = self.tx.query(f"SELECT t.* FROM trajectories t WHERE {condition} ORDER BY t.created_at", params)
        rows = rows if id_prefix is None else [row for row in rows if row["id"].startswith(id_prefix)]
        for row in rows:
            row["metadata"] = loads(row["metadata"])
        return rows

    def trajectories_in_group(self, group_id: str) -> list[str]:
        """Ids of the group's trajectories."""
        return [row[0] for row in self.tx.conn.execute("SELECT id FROM trajectories WHERE group_id = ?",
                                                       [group_id])]

    def unsuccessful_runs(self) -> list[str]:
        """Ids of the runner's trajectories whose run crashed or timed out (``metadata.outcome`` not ok)."""
        return [row[0] for row in self.tx.conn.execute(
            "SELECT id FROM trajectories WHERE json_extract(metadata, '$.outcome') != 'ok'")]

    # -- scoring fields: a task's answers and tests, apart from what agents can read ------------
    def set_scoring_fields(self, trajectory_id: str, fields: dict) -> None:
        with self.tx.write() as conn:
            conn.execute("INSERT OR REPLACE INTO scoring_fields (trajectory_id, fields) VALUES (?, ?)",
                         [trajectory_id, dumps(fields)])

    def scoring_fields(self, trajectory_id: str) -> dict:
        row = self.tx.conn.execute("SELECT fields FROM scoring_fields WHERE trajectory_id = ?",
                                   [trajectory_id]).fetchone()
        return (loads(row[0]) or {}) if row else {}
