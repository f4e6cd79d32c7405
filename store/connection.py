"""Opening the SQLite file, write transactions and batches, and checkpoints of its WAL.

Writers open it read-write (WAL, migrations applied); readers (exports, stats, the UI) can open
it read-only and never take the write lock, so they work while another process writes.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from stepmill.store.sqlite_library import sqlite_utils  # without pandas: see there
from stepmill.errors import BadInput, StoreUnavailable
from stepmill.private_files import private_opener
from stepmill.store.cache import LRU
from stepmill.store.migrations import MIGRATIONS, migrate, pending
from stepmill.store.sql_errors import file_errors

BUSY_TIMEOUT_MS = 30000
# Every commit writes each page it touched whole to the WAL: a captured call touches about 20 (the steps
# row and its indexes, its trajectory, the journal position), so the page size sets what a commit costs,
# and steps are rows of a few KB, which smaller pages hold with more space left over. 8 KiB pages: the
# writer's CPU per call 9% under 16 KiB ones (4 KiB: 17%), the file 2% larger (4 KiB: 22%) on 50-turn
# tool loops (bench/commit_bench.py); reads of token rows are as fast.
PAGE_SIZE = 8192
CHECKPOINT_MODES = ("PASSIVE", "FULL", "RESTART", "TRUNCATE")

def _private_database(path: str) -> None:
    """SQLite gives -wal, -shm and -journal the database file's mode, so the file is made 0600 before
    SQLite opens it; leftovers of an older stepmill that others could read are closed too."""
    if path in ("", ":memory:") or path.startswith("file:"):
        return
    # Never a descriptor of a file that exists: closing it would drop every lock SQLite holds on it in this
    # process (POSIX), and another process closing the file last would then delete the WAL under this
    # process's open connections (a thread writer opening beside the proxy's store and state watch).
    try:
        if os.path.exists(path):
            if os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
        else:
            os.close(private_opener(path, os.O_RDWR | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass  # made by another process a moment ago: it is made owner-only there
    except OSError:
        return  # SQLite says why it cannot open it
    for suffix in ("-wal", "-shm", "-journal"):
        try:
            if os.stat(path + suffix).st_mode & 0o077:
                os.chmod(path + suffix, 0o600)
        except OSError:
            pass


def open_database(path: str, *, readonly: bool = False) -> tuple[sqlite_utils.Database, int]:
    """(database, schema version). A read-only open never writes, not even a migration.

    Opened for writing, the file (created 0600 if new) and its -wal/-shm are made owner-only (0600)
    when group or others could read them.
    """
    if readonly:
        if not Path(path).exists():
            raise StoreUnavailable(f"no stepmill database at {path}")
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000,
                               check_same_thread=False, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db = sqlite_utils.Database(conn)
        missing = pending(db)
        if missing and len(missing) == len(MIGRATIONS):
            raise StoreUnavailable(f"{path} is not a stepmill database (no schema); open it once with a writer")
        if missing:
            raise StoreUnavailable(f"{path} has schema version {len(MIGRATIONS) - len(missing)}, this stepmill reads "
                             f"{len(MIGRATIONS)}; open it once with a writer (e.g. `stepmill proxy`) to migrate")
        return db, len(MIGRATIONS)
    _private_database(path)
    with _setting_up(path):
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False, isolation_level=None)
        db = sqlite_utils.Database(conn)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # only takes effect on a new file
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            db.enable_wal()
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        return db, migrate(db)


@contextmanager
def _setting_up(path: str) -> Iterator[None]:
    """One process at a time sets a file up. Processes opening a new file at once (a proxy's workers)
    would race: switching to WAL and migrating take SQLite's locks in ways its busy handler cannot
    always wait out ("database is locked"). The lock is on the file's folder (flock), not the file: a
    descriptor of the database closed here would drop SQLite's own locks of this process on it."""
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the flock


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, taken up front so concurrent writers queue instead of failing. A file
    that takes no writes now (locked past the busy timeout, full, read-only, an I/O error), at any
    point up to the commit, raises ``StoreUnavailable``: the caller keeps what it meant to write."""
    with file_errors():
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:  # SQLite rolls some failures (a full disk) back itself
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


class Transactions:
    """The one connection every part of ``Store`` shares: closing, write transactions, batches and WAL
    checkpoints.

    ``cache`` is the LRU of what the parts read through it (conversations, token ids, blobs).
    Inside ``batch()``, ``pending`` holds the cache entries the batch's calls made, published only
    once it commits (None outside a batch).
    """

    def __init__(self, db: sqlite_utils.Database, *, path: str, readonly: bool, cache: LRU):
        self.db = db
        self.conn = db.conn
        self.path = path
        self.readonly = readonly
        self.cache = cache
        self.pending: list | None = None

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front so concurrent writers queue instead of failing."""
        if self.readonly:
            raise StoreUnavailable(f"{self.path} was opened read-only")
        with write_transaction(self.conn) as conn:
            yield conn

    @contextmanager
    def batch(self) -> Iterator[sqlite3.Connection]:
        """One write transaction around many ``record_steps`` (and ``set_state``) calls: the writer
        commits in batches. What the calls cached is kept only once the batch commits."""
        self.pending = []
        try:
            with self.write() as conn:
                yield conn
            for key, value in self.pending:
                self.cache.put(key, value)
        finally:
            self.pending = None

    @property
    def in_batch(self) -> bool:
        return self.pending is not None

    def cache_when_committed(self, entries: list) -> None:
        """Cache entries of rows written in the current batch: a batch rolled back never caches them."""
        self.pending.extend(entries)

    @contextmanager
    def savepoint(self, name: str) -> Iterator[sqlite3.Connection]:
        """A part of the current write transaction that a failure undoes alone; the file taking no
        writes raises ``StoreUnavailable`` here too, so that no caller mistakes it for a bad record."""
        conn = self.conn
        with file_errors():
            conn.execute(f"SAVEPOINT {name}")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute(f"ROLLBACK TO {name}")
                    conn.execute(f"RELEASE {name}")
                raise
            conn.execute(f"RELEASE {name}")

    def query(self, sql: str, params: Any = ()) -> list[dict]:
        """Rows of a read query, as dicts (inside the store and in tests; callers ask named methods)."""
        return list(self.db.query(sql, params))

    def data_version(self) -> int:
        """A number that changes whenever another connection commits to the file."""
        return self.conn.execute("PRAGMA data_version").fetchone()[0]

    def manage_checkpoints(self) -> None:
        """Turn SQLite's automatic checkpoints off: the writer process checkpoints between its batches."""
        self.conn.execute("PRAGMA wal_autocheckpoint = 0")

    def checkpoint(self, mode: str) -> bool:
        """Fold the WAL into the file ("PASSIVE" or "TRUNCATE"); False when a reader holds the WAL."""
        if mode not in CHECKPOINT_MODES:
            raise BadInput(f"a checkpoint mode is one of {', '.join(CHECKPOINT_MODES)}, not {mode!r}")
        try:
            busy = self.conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()[0]
        except sqlite3.OperationalError:
            return False
        return not busy
