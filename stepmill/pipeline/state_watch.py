"""Off the event loop, on a thread of its own: what other processes change in the database that the
proxy must know at once — the policy version (``stepmill policy-version``) and newly registered (or revoked) runs.

The watch owns a read-only store and looks at its ``data_version`` (which changes when another
connection commits); only then does it read, and it reports through the callbacks it was given.
The proxy caches what it is told, so no hook ever reads the file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from stepmill.auth.runs import Run
from stepmill.store import Store

log = logging.getLogger("stepmill")

REFRESH = 0.5  # seconds between looks at the file


class StateWatch:
    """Reads once when made (in the caller's thread), then watches on its own thread until ``stop``.

    ``on_policy_version(version)`` is told the policy version at every change of the file;
    ``on_run(run)`` each run registered since the last look (oldest first, each once).
    """

    def __init__(self, db_path: str, *, on_policy_version: Callable[[str | None], None],
                 on_run: Callable[[Run], None], refresh: float = REFRESH):
        self.on_policy_version = on_policy_version
        self.on_run = on_run
        self.refresh = refresh
        self.seen_rowid = 0  # the last registration read
        self._stop = threading.Event()
        self.store = Store(db_path, readonly=True)
        self._seen_version = self.store.data_version()
        self._read()
        self.thread = threading.Thread(target=self._run, name="stepmill-state-watch", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        self.on_policy_version(self.store.policy_version())
        for row in self.store.registered_runs(self.seen_rowid):
            self.on_run(Run(row["trajectory_id"], row["group_id"], row["channel"], row["secret_hash"], row["rowid"],
                            revoked=row["revoked_at"] is not None, door=row["door"], hosts=tuple(row["hosts"])))
            self.seen_rowid = row["rowid"]

    def _run(self) -> None:
        failing = None
        while not self._stop.wait(self.refresh):
            try:
                version = self.store.data_version()
                if version != self._seen_version:
                    self._read()
                    self._seen_version = version  # seen once read: a failed read is read again next time
                if failing is not None:
                    log.warning("stepmill: the state watch reads the database again")
                    failing = None
            except Exception as exc:  # a busy file: what was reported stands until the next look
                if failing is None:
                    log.warning(f"stepmill: the state watch cannot read the database ({exc}); it tries again")
                failing = str(exc)
        self.store.close()

    def stop(self) -> None:
        """Ends the watch (its thread closes the store on its way out)."""
        self._stop.set()
