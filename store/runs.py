"""The runner's registered runs (the ``run_credentials`` table): a run's trajectory written only with
its secret, the hash of its door's key (what binds a sandboxed run's connections to it), revocations,
and how far each run is."""

from __future__ import annotations

from stepmill.errors import Conflict, NotFound
from stepmill.store.assign import set_trajectory_fields
from stepmill.store.connection import Transactions
from stepmill.store.encoding import dumps, loads
from stepmill.store.ids import now_iso


class Runs:
    """Register, revoke and read runs; each registration or revocation is a new row (the latest holds)."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def register_run(self, trajectory_id: str, secret_hash: str, *, door: str | None = None,
                     hosts: list | None = None) -> dict:
        """The runner's run: its trajectory (which must exist) may now be written only with the secret.
        ``door``: the hash of the key a sandboxed run's door adds to its connections (Conflict while a run
        not revoked has it); ``hosts``: the host[:port] entries it may reach through the proxy."""
        with self.tx.write() as conn:
            row = conn.execute("SELECT group_id, channel FROM trajectories WHERE id = ?", [trajectory_id]).fetchone()
            if row is None:
                raise NotFound(trajectory_id)
            if door is not None and conn.execute(
                    "SELECT 1 FROM run_credentials rc WHERE door = ? AND trajectory_id != ? AND rowid ="
                    " (SELECT max(rowid) FROM run_credentials WHERE trajectory_id = rc.trajectory_id)"
                    " AND revoked_at IS NULL", [door, trajectory_id]).fetchone():
                raise Conflict(f"door {door} belongs to a run that has not ended")
            cursor = conn.execute(
                "INSERT INTO run_credentials (trajectory_id, group_id, channel, secret_hash, created_at, door, hosts)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)", [trajectory_id, row[0], row[1], secret_hash, now_iso(), door,
                                                  dumps(hosts) if hosts else None])
            # A trajectory nobody registered that already sits in this group (written before any run of
            # it was registered) would keep the group open for ever: it moves to a group of its own.
            for (foreign,) in conn.execute(
                    "SELECT id FROM trajectories WHERE group_id = ? AND id NOT IN"
                    " (SELECT trajectory_id FROM run_credentials)", [row[0]]).fetchall() if row[0] else []:
                set_trajectory_fields(conn, foreign, {"group_id": f"{row[0]}~unregistered"})
        return {"rowid": cursor.lastrowid, "trajectory_id": trajectory_id, "group_id": row[0], "channel": row[1],
                "secret_hash": secret_hash, "door": door, "hosts": list(hosts or [])}

    def latest_run(self, trajectory_id: str) -> dict | None:
        """The run's registration (or revocation) in force, read only; None when it was never registered."""
        rows = self.tx.query("SELECT rowid, trajectory_id, group_id, channel, secret_hash, revoked_at, door"
                             " FROM run_credentials WHERE trajectory_id = ? ORDER BY rowid DESC LIMIT 1",
                             [trajectory_id])
        return rows[0] if rows else None

    def revoke_run(self, trajectory_id: str) -> dict | None:
        """The run's secret stops working: a newer row without one (None when it was never registered,
        the row in force when it is revoked already)."""
        with self.tx.write() as conn:
            row = conn.execute("SELECT rowid, group_id, channel, secret_hash, revoked_at, door FROM run_credentials"
                               " WHERE trajectory_id = ? ORDER BY rowid DESC LIMIT 1", [trajectory_id]).fetchone()
            if row is None:
                return None
            if row[4] is not None:
                return {"rowid": row[0], "trajectory_id": trajectory_id, "group_id": row[1], "channel": row[2],
                        "secret_hash": row[3], "revoked_at": row[4], "door": row[5]}
            revoked_at = now_iso()
            cursor = conn.execute(  # the door stays the run's: what still comes through it is refused
                "INSERT INTO run_credentials (trajectory_id, group_id, channel, secret_hash, created_at, revoked_at,"
                " door) VALUES (?, ?, ?, '', ?, ?, ?)", [trajectory_id, row[1], row[2], revoked_at, revoked_at, row[5]])
        return {"rowid": cursor.lastrowid, "trajectory_id": trajectory_id, "group_id": row[1], "channel": row[2],
                "secret_hash": "", "revoked_at": revoked_at, "door": row[5]}

    def registered_runs(self, after_rowid: int = 0) -> list[dict]:
        """Registrations and revocations newer than ``after_rowid``, oldest first (a later one replaces
        an earlier)."""
        rows = self.tx.query("SELECT rowid, trajectory_id, group_id, channel, secret_hash, revoked_at, door, hosts"
                             " FROM run_credentials WHERE rowid > ? ORDER BY rowid", [after_rowid])
        for row in rows:
            row["hosts"] = loads(row["hosts"]) or []
        return rows

    def run_readiness(self) -> list[dict]:
        """How far each run registered in this file is (what a node reports to the coordinator):
        trajectory_id, group_id, channel, complete, scored, policy_version, group_size (the group's
        registered runs here). ``registered_runs`` is another thing: the registrations themselves."""
        rows = self.tx.query(
            "SELECT t.id AS trajectory_id, t.group_id, t.channel, t.status = 'complete' AS complete,"
            " t.reward IS NOT NULL AS scored, t.policy_version,"
            " (SELECT count(DISTINCT rc2.trajectory_id) FROM run_credentials rc2"
            "  JOIN trajectories t2 ON t2.id = rc2.trajectory_id WHERE t2.group_id = t.group_id) AS group_size"
            " FROM trajectories t WHERE t.id IN (SELECT trajectory_id FROM run_credentials)"
            " AND t.group_id IS NOT NULL ORDER BY t.created_at, t.id")
        for row in rows:
            row["complete"], row["scored"] = bool(row["complete"]), bool(row["scored"])
        return rows

    def registered_at(self, trajectory_id: str) -> str | None:
        """When the run's latest attempt was registered (its steps start after), or None."""
        row = self.tx.conn.execute("SELECT max(created_at) FROM run_credentials WHERE trajectory_id = ?"
                                   " AND revoked_at IS NULL", [trajectory_id]).fetchone()
        return row[0] if row else None
