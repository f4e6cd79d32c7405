"""Opening the SQLite file and taking write transactions.

Writers open it read-write (WAL, migrations applied); readers (exports, stats, the UI) can open
it read-only and never take the write lock, so they work while another process writes.
"""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlite_utils

from .migrations import MIGRATIONS, migrate, pending

BUSY_TIMEOUT_MS = 30000


class StoreError(ValueError):
    """A request the store refuses, with a message saying why."""


def open_database(path: str, *, readonly: bool = False) -> tuple[sqlite_utils.Database, int]:
    """(database, schema version). A read-only open never writes, not even a migration."""
    if readonly:
        if not Path(path).exists():
            raise StoreError(f"no stepmill database at {path}")
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000,
                               check_same_thread=False, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db = sqlite_utils.Database(conn)
        missing = pending(db)
        if missing and len(missing) == len(MIGRATIONS):
            raise StoreError(f"{path} is not a stepmill database (no schema); open it once with a writer")
        if missing:
            raise StoreError(f"{path} has schema version {len(MIGRATIONS) - len(missing)}, this stepmill reads "
                             f"{len(MIGRATIONS)}; open it once with a writer (e.g. `stepmill proxy`) to migrate")
        return db, len(MIGRATIONS)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False, isolation_level=None)
    db = sqlite_utils.Database(conn)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    # Steps are rows of a few KB; bigger pages waste less of each page (only takes effect on a new file).
    conn.execute("PRAGMA page_size = 16384")
    if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        db.enable_wal()
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    return db, migrate(db)


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, taken up front so concurrent writers queue instead of failing."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
