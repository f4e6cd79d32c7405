"""Small named values of the database (the ``state`` table): the policy version, journal positions."""

from __future__ import annotations

import bisect
import time

from stepmill.store.connection import Transactions
from stepmill.store.sql_errors import file_errors

JOURNAL_PREFIX = "journal:"  # a journal's committed position is kept under journal:<id>


class State:
    """Get and set ``state`` keys and the policy version."""

    def __init__(self, tx: Transactions):
        self.tx = tx
        # The policy history as read so far, for policy_versions_at: stepmill only appends rows, each set
        # no earlier than the one before (see _set_policy_version); rows deleted by hand are noticed.
        self._history_rowid = 0
        self._history_rows = 0  # rows read, their time a number or not
        self._history_times: list[float] = []
        self._history_versions: list[str | None] = []

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
        with file_errors():  # the API's one-step lookup; the writer asks policy_versions_at
            row = self.tx.conn.execute("SELECT version FROM policy_versions WHERE set_at <= ? ORDER BY set_at "
                                       "DESC, rowid DESC LIMIT 1", [when]).fetchone()
        return row[0] if row else None

    def policy_versions_at(self, times: list) -> list[str | None]:
        """``policy_version_at`` of each of ``times`` with one query (the writer asks for every call of a
        batch): the rows added since the last look are read, the rest is remembered (all of it read again
        when rows went: a history cleared by hand). A time that is no number gets the latest version; a row
        whose time is no number (written by hand) is never an answer, as in SQL."""
        with file_errors():
            rows = self.tx.conn.execute("SELECT rowid, set_at, version FROM policy_versions WHERE rowid > ? "
                                        "ORDER BY rowid", [self._history_rowid]).fetchall()
            total = self.tx.conn.execute("SELECT count(*) FROM policy_versions").fetchone()[0]
            if total != self._history_rows + len(rows):  # rows deleted: start over
                self._history_rowid, self._history_rows = 0, 0
                self._history_times, self._history_versions = [], []
                rows = self.tx.conn.execute("SELECT rowid, set_at, version FROM policy_versions ORDER BY rowid"
                                            ).fetchall()
        if rows:
            self._history_rowid = rows[-1][0]
            self._history_rows += len(rows)
            rows = [row for row in rows if _is_time(row[1])]
            self._history_times += [set_at for _, set_at, _ in rows]
            self._history_versions += [version for _, _, version in rows]
            if any(a > b for a, b in zip(self._history_times, self._history_times[1:])):  # never so, but exact
                pairs = sorted(zip(self._history_times, range(len(self._history_times)), self._history_versions))
                self._history_times = [t for t, _, _ in pairs]
                self._history_versions = [v for _, _, v in pairs]
        out = []
        for when in times:
            if _is_time(when):
                index = bisect.bisect_right(self._history_times, when)
            else:
                index = len(self._history_times)
            out.append(self._history_versions[index - 1] if index else None)
        return out


def _is_time(value) -> bool:
    """A number SQL orders as one (NaN is stored as NULL)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
