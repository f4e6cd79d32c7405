"""The capture pipeline of one database, started and stopped as one piece by the proxy's addon.

    event loop ──submit()──▶ handoff thread ──▶ journal ──▶ writer (a thread, or a process of its own) ──▶ store

``submit``, ``handed_off`` and ``flushed`` are called on the event loop and never block it;
everything else runs off it: the handoff and writer threads (or process), the state watch's thread,
and ``status`` and ``close``, which the addon calls from its control thread or at shutdown. The
addon reaches the store's file only through here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor

from stepmill.auth.runs import RegisteredRun
from stepmill.errors import ConfigError
from stepmill.store import Store
from stepmill.pipeline.call_record import CallRecord
from stepmill.pipeline.handoff import DURABILITY, Handoff
from stepmill.pipeline.journal import UNREADABLE_KEY, Journal
from stepmill.pipeline.state_watch import StateWatch
from stepmill.pipeline.writer import PRIORITIES, ProcessWriter, ThreadWriter

log = logging.getLogger("stepmill")

WRITERS = ("process", "thread")  # where steps are parsed and written: a process of its own, or a proxy thread
POLL = 0.02  # seconds between looks while ``flushed`` waits

__all__ = ["DURABILITY", "PRIORITIES", "WRITERS", "Pipeline"]


class Pipeline:
    """The journal, the handoff thread and the writer of one database.

    ``store`` is the pipeline's read-write store (opened first: it creates or migrates the file
    before anyone writes); the control API may share it, from one thread.
    """

    def __init__(self, db_path: str, *, writer: str = "process", priority: str = "idle", durability: str = "gathered"):
        if writer not in WRITERS:
            raise ConfigError(f"a writer is one of {', '.join(WRITERS)}, not {writer!r}")
        if priority not in PRIORITIES:
            raise ConfigError(f"a writer priority is one of {', '.join(PRIORITIES)}, not {priority!r}")
        if durability not in DURABILITY:
            raise ConfigError(f"durability is one of {', '.join(DURABILITY)}, not {durability!r}")
        self.db_path = db_path
        self.writer_kind, self.priority = writer, priority
        self.store = Store(db_path)
        self.journal = Journal.create(db_path)
        self.writer = ThreadWriter(db_path, self.journal) if writer == "thread" else \
            ProcessWriter(db_path, self.journal, priority)
        self.handoff = Handoff(self.journal, self.writer.notify, durability=durability)
        self.watch: StateWatch | None = None  # from watch_runs
        self.submitted = 0  # calls handed over by the loop (changed on the loop only)

    def watch_runs(self, on_run: Callable[[RegisteredRun], None]) -> None:
        """Starts the state watch of this database: ``on_run`` is told of every run registered (or
        revoked) by any process, those already there first, before this returns."""
        self.watch = StateWatch(self.db_path, on_run=on_run)

    # -- on the event loop ----------------------------------------------------------------
    def submit(self, record: CallRecord, blobs: list[bytes]) -> None:
        """A finished call: O(1), no I/O (references to bytes the loop already has)."""
        self.handoff.submit(record, blobs)
        self.submitted += 1

    def handed_off(self) -> int:
        """Calls submitted that are in the journal now, or were dropped (memory full)."""
        return self.handoff.appended + self.handoff.dropped

    async def flushed(self, deadline: float, executor: Executor) -> bool:
        """Waits, without blocking the loop, until every call submitted so far is in the journal and the
        writer committed the journal up to where it then ended; False if ``time.monotonic()`` passed
        ``deadline`` first. The store is read in ``executor`` (the thread that owns ``store``'s use)."""
        target = self.submitted
        self.handoff.hurry()
        while self.handed_off() < target and time.monotonic() < deadline:
            await asyncio.sleep(POLL)
        end = self.journal.end()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(executor, self.writer.flush)  # now, not at the end of its window
        while time.monotonic() < deadline:
            if await loop.run_in_executor(executor, lambda: self.journal.committed(self.store) >= end):
                return True
            await asyncio.sleep(POLL * 5)
        return False

    # -- off the event loop ---------------------------------------------------------------
    def threads(self) -> dict:
        """Whether the handoff thread, the writer (thread or process) and the state watch live, and why
        one is behind; from memory only (no file is read: the event loop may ask)."""
        threads = {"handoff": {"alive": self.handoff.thread.is_alive(), "error": self.handoff.behind},
                   "writer": self.writer.status()}
        if self.watch is not None:  # started by the proxy (watch_runs), not by every user of a pipeline
            threads["state_watch"] = self.watch.status()
        return {"alive": all(thread["alive"] for thread in threads.values()), "threads": threads}

    def status(self) -> dict:
        """The pipeline's state, for health and stats: whether its threads (and writer process) live, the
        calls it could not keep or read, the backlog in memory and in the journal."""
        out = {**self.threads(), "writer": self.writer_kind}
        if self.writer_kind != "thread":
            out["writer_priority"] = self.priority
        out.update(self.handoff.status())
        out["unreadable_calls"] = int(self.store.get_state(UNREADABLE_KEY) or 0)  # by every writer of the file
        out["uncommitted_bytes"] = self.journal.backlog(self.journal.committed(self.store))
        return out

    def close(self) -> None:
        """Drains the handoff and the writer; a journal not wholly committed stays for the next start."""
        if self.watch is not None:
            self.watch.stop()
        self.handoff.close()
        self.writer.close()
        if not self.journal.retire(self.store):
            log.warning(f"stepmill: calls left in {self.journal.folder}; the next start commits them")
        self.journal.release()
        self.store.close()
