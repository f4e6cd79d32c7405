"""Small named values of the database (the ``state`` table): the policy version, journal positions."""

from __future__ import annotations

import time

from stepmill.store.connection import Transactions
from stepmill.store.sql_errors import file_errors

JOURNAL_PREFIX = "journal:"  # a journal's committed position is kept under journal:<id>


class State:
    """Get and set ``state`` keys and the policy version."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def get_state(self, key: str, default: str | None = None) -> str | None:
        with file_errors():  # the writer reads its journal's position so before every batch
            row = self.tx.conn.execute("SELECT value FROM state WHERE key = ?", [key]).fetchone()
        return row[0] if row else default

    def set_state(self, key: str, value: str | None) -> None:
        """None removes the key. Inside ``batch()`` it joins that transaction (the writer commits a
        journal position with the steps it read)."""
        if self.tx.in_batch:
            self._set_state(self.tx.conn, key, value)
            return
        with self.tx.write() as conn:
            self._set_state(conn, key, value)

    @staticmethod
    def _set_state(conn, key: str, value: str | None) -> None:
        if value is None:
            conn.execute("DELETE FROM state WHERE key = ?", [key])
        else:
            conn.execute("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)", [key, value])

    def journal_positions(self) -> dict[str, str]:
        """Every journal's committed position, by state key (``journal:<id>``)."""
        return {k: v for k, v in self.tx.conn.execute(
            "SELECT key, value FROM state WHERE key LIKE ?", [JOURNAL_PREFIX + "%"])}

    def policy_version(self) -> str | None:
        return self.get_state("policy_version")

    def set_policy_version(self, version: str | int | None, *, since: float | None = None) -> None:
        """The version from now on (from ``since``, epoch seconds, when given: a trainer that paused its
        engine sets the new version from the pause, so every call the engine held is stamped with the
        weights it is served by), and in the history (same transaction) the calls are stamped from."""
        value = None if version is None else str(version)
        if self.tx.in_batch:
            self._set_policy_version(self.tx.conn, value, since)
            return
        with self.tx.write() as conn:
            self._set_policy_version(conn, value, since)

    def _set_policy_version(self, conn, value: str | None, since: float | None = None) -> None:
        self._set_state(conn, "policy_version", value)
        # Never earlier than the last one: a clock stepped back must not put an older version after a newer.
        conn.execute("INSERT INTO policy_versions (set_at, version) SELECT max(?, coalesce(max(set_at), 0)), ?"
                     " FROM policy_versions", [time.time() if since is None else min(since, time.time()), value])

    def policy_version_at(self, when: float) -> str | None:
        """The version in effect at ``when`` (epoch seconds): the last one set by then (None before any)."""
        with file_errors():  # read by the writer for every call it records
            row = self.tx.conn.execute("SELECT version FROM policy_versions WHERE set_at <= ? ORDER BY set_at "
                                       "DESC, rowid DESC LIMIT 1", [when]).fetchone()
        return row[0] if row else None

