"""Off the event loop, on a thread of its own: the runs other processes register (or revoke) in the
database, which the proxy must know at once to check a run's credentials.

The watch owns a read-only store and looks at its ``data_version`` (which changes when another
connection commits); only then does it read, and it reports through the callback it was given.
The proxy caches what it is told, so no hook ever reads the file. (The policy version is not
watched: the writer stamps each call from the file's history.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from stepmill.auth.runs import RegisteredRun
from stepmill.store import Store

log = logging.getLogger("stepmill")

REFRESH = 0.5  # seconds between looks at the file


class StateWatch:
    """Reads once when made (in the caller's thread), then watches on its own thread until ``stop``.

    ``on_run(run)`` is told each run registered since the last look (oldest first, each once). A look
    that fails is not marked seen: the next one reads again. A registration that cannot be made into a
    run is logged, counted (``unreadable_runs``) and passed over: the ones after it are still told.
    """

    def __init__(self, db_path: str, *, on_run: Callable[[RegisteredRun], None], refresh: float = REFRESH):
        self.on_run = on_run
        self.refresh = refresh
        self.seen_rowid = 0  # the last registration read
        self.unreadable_runs = 0
        self.failing: str | None = None  # why the last look failed
        self._stop = threading.Event()
        self.store = Store(db_path, readonly=True)
        self._seen_version: int | None = None  # the data_version last read in full
        self._look()
        self.thread = threading.Thread(target=self._run, name="stepmill-state-watch", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for row in self.store.registered_runs(self.seen_rowid):
            try:
                self.on_run(RegisteredRun(row["trajectory_id"], row["group_id"], row["channel"], row["secret_hash"],
                                row["rowid"], revoked=row["revoked_at"] is not None, door=row["door"],
                                hosts=tuple(row["hosts"] or ())))
            except Exception as exc:
                self.unreadable_runs += 1
                log.warning(f"stepmill: passed over the registration of run {row.get('trajectory_id')!r}: "
                            f"{type(exc).__name__}: {exc}")
            self.seen_rowid = row["rowid"]

    def _look(self) -> None:
        """Reads what changed since the last look; never raises."""
        try:
            version = self.store.data_version()
            if version != self._seen_version:
                self._read()
                self._seen_version = version  # seen once read: a failed read is read again next time
            if self.failing is not None:
                log.warning("stepmill: the state watch reads the database again")
                self.failing = None
        except Exception as exc:  # a busy file: what was reported stands until the next look
            if self.failing is None:
                log.warning(f"stepmill: the state watch cannot read the database ({exc}); it tries again")
            self.failing = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        while not self._stop.wait(self.refresh):
            self._look()
        self.store.close()

    def status(self) -> dict:
        return {"alive": self.thread.is_alive(), "error": self.failing, "unreadable_runs": self.unreadable_runs}

    def stop(self) -> None:
        """Ends the watch (its thread closes the store on its way out)."""
        self._stop.set()
