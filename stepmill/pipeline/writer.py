"""Off the event loop: the writer, from the journal to the store.

    event loop ──submit()──▶ handoff thread ──append──▶ journal ──▶ Writer ──batch──▶ store
      (bytes only)             (handoff.py)               (on disk)   (a thread, or its own process)

The writer reads what the handoff appended, parses, links and writes in batches, one
transaction each, recording how far in the journal it got in that same transaction; it
checkpoints the WAL itself. A locked database or a full disk only
makes the journal grow; the calls are committed when the file takes writes again, or by the
next writer that starts. Run as a process (``python -m stepmill.pipeline.writer``), the writer
gets a core of its own and its parsing never holds the proxy's GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from stepmill.errors import StoreUnavailable
from stepmill.store import Store
from stepmill.pipeline.call_record import CallRecord
from stepmill.pipeline.handoff import COMMIT_WINDOW
from stepmill.pipeline.ingest import Ingest
from stepmill.pipeline.journal import UNREADABLE_KEY, Journal, Position, entry_identity, forget_removed, state_key

log = logging.getLogger("stepmill")

BATCH_BYTES = 8 * 1024 * 1024  # journal bytes per transaction at most
# COMMIT_WINDOW (handoff.py): seconds the writer gathers calls before committing them, unless asked to flush
CHECKPOINT_WAL_BYTES = 32 * 1024 * 1024  # the writer checkpoints after committing this much, or when idle
CHECKPOINT_IDLE = 5.0  # seconds without calls after which the WAL is checkpointed
SEARCH_WAIT = 1.0  # seconds from a commit to its steps in the full-text index (store/search.py), while the file takes writes
RETRY_WAIT = 0.5  # after a locked database or a full disk
STUCK_WAIT = 30.0  # at most, between tries of an entry that cannot be committed even as an error step
ORPHAN_GRACE = 5.0  # seconds a writer process commits on once its proxy is gone; then it exits, done or not
ORPHAN_SCAN = 30.0  # seconds between looks, while idle, for journals whose writers are gone (they are replayed)
FLUSH = b"f"  # on a writer process's stdin: commit now (a newline only wakes it)
RESTART_WAIT = 5.0  # seconds from a writer process's start before one that died is started again


class Writer:
    """Commits journal entries to SQLite in batches; replays journals left by writers that died."""

    def __init__(self, db_path: str, journal_folder: Path, priority: Priority | None = None,
                 stdin: int | None = None):
        self.db_path = db_path
        self.journal = Journal(journal_folder)
        self.priority = priority or Priority("normal")
        self._wake = threading.Event()
        self._stdin = stdin  # a writer process: the proxy's wake-ups, read here (no thread between per call)
        self._stop = False
        self._flush_asked = False  # commit what there is now, without the rest of the window
        self._again = False  # a wake-up came while gathering: gather and read once more (see _gather)
        self.committed = 0
        self.last_commit: float | None = None
        self.failing: str | None = None  # why the last batch did not commit (it is tried again)
        self._stuck_waits = 0  # tries in a row that could not commit an entry even alone: each waits longer
        self._orphans_seen = 0.0  # when journals left by writers that are gone were last looked for
        # A writer process tells the proxy why it is behind through this file (None: a thread, read directly).
        self.status_path: Path | None = None
        self._since_checkpoint = 0
        # When steps were first committed past the search index; at start, a look at whether anyone's are.
        self._unindexed_since: float | None = time.monotonic()
        self._search_failing = False
        # Each journal's committed position, read from the store once: this writer is the only one that
        # commits it (a journal is locked while its writer lives), so memory stays true after each commit.
        self._positions: dict[str, Position] = {}

    def wake(self) -> None:
        self._wake.set()

    def flush(self) -> None:
        """Commit what the journal holds now (a barrier waits for it), not at the end of the window."""
        self._flush_asked = True
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def run(self) -> None:
        opened = self._start()
        if opened is None:
            return  # stopped before the database could be opened: the calls wait in the journal
        store, ingest = opened
        dirty = False
        while True:
            woken = self._wait(self._timeout(dirty))
            if not woken and not self.failing:
                if time.monotonic() - self._orphans_seen >= ORPHAN_SCAN:
                    self._replay_orphans(store, ingest)  # a writer gone after this one started left one
                if self._unindexed_since is not None:
                    self._index_search(store)
                if dirty and time.time() - (self.last_commit or 0) >= CHECKPOINT_IDLE:
                    self._checkpoint(store, "PASSIVE")  # idle: a good moment to fold the WAL into the file
                    dirty = False
                continue
            stopping = self._stop
            if woken:
                self._gather()
            before = self.committed
            while self._drain(store, ingest, self.journal):
                pass
            if self.committed > before:
                dirty = True
                if self._unindexed_since is None:
                    self._unindexed_since = time.monotonic()
            if self._unindexed_since is not None and not self.failing and (
                    stopping or time.monotonic() - self._unindexed_since >= SEARCH_WAIT):
                self._index_search(store)  # under a steady stream of calls, once per SEARCH_WAIT
            if stopping and (not self.failing or self._stuck_waits):
                break  # an entry that cannot be committed stays in the journal for the next writer
        self._checkpoint(store, "TRUNCATE")
        store.close()
        self.journal.release()  # the segment kept open for reading

    def _start(self) -> tuple[Store, Ingest] | None:
        """The store opened and the journals of writers that stopped replayed; what fails here (a file
        locked or missing for now, a retire that fails) is logged, kept in ``failing`` and tried again,
        never the writer's silent end. None when stopped meanwhile."""
        while True:
            store = None
            try:
                store = Store(self.db_path)
                store.manage_checkpoints()  # checkpoints happen here, between batches
                ingest = Ingest(store)
                forget_removed(store)
                self._replay_orphans(store, ingest)
                if self.failing is not None and self.failing.startswith("the writer cannot start"):
                    log.warning("stepmill: the writer started")
                    self._set_failing(None)
                self._again = True  # the wake-ups taken while it could not start: read its journal first
                return store, ingest
            except Exception as exc:
                if self.failing is None:
                    log.exception("stepmill: the writer cannot start; calls stay in the journal and it tries again")
                self._set_failing(f"the writer cannot start: {type(exc).__name__}: {exc}")
                if store is not None:
                    store.close()
            self._wait(RETRY_WAIT)
            if self._stop:
                return None

    def _replay_orphans(self, store: Store, ingest: Ingest) -> None:
        """Commit and retire the journals whose writers are gone (their lock is free): at start, and every
        ORPHAN_SCAN while idle, for a writer that outlived this one's start (its grace after its proxy died)."""
        self._orphans_seen = time.monotonic()
        for orphan in Journal.orphans(self.db_path):
            if orphan.folder == self.journal.folder:
                continue
            log.info(f"stepmill: replaying the journal {orphan.folder} left by a writer that stopped")
            while self._drain(store, ingest, orphan):
                pass
            if not orphan.retire(store):
                orphan.release()  # not all of it committed: the next look takes it again

    def _gather(self) -> None:
        """Let the calls of one COMMIT_WINDOW share a transaction, unless a flush or a stop comes first.

        The handoff wakes the writer at most once a window and counts on a woken writer reading the
        journal a window after the wake-up. A wake-up (or a flush) taken in here came after this
        window began, so it is kept for the next one: the calls it announced, and those it left
        unannounced, are read then."""
        deadline = time.monotonic() + COMMIT_WINDOW
        again = False
        while not (self._flush_asked or self._stop):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            again = self._wait(left) or again
        self._again = again or self._flush_asked
        self._flush_asked = False

    def _timeout(self, dirty: bool) -> float | None:
        """How long to wait for calls before the next thing to do when none come."""
        if self.failing:
            return min(RETRY_WAIT * 2 ** min(self._stuck_waits, 8), STUCK_WAIT)
        waits = [ORPHAN_SCAN - (time.monotonic() - self._orphans_seen)]
        if self._unindexed_since is not None:
            waits.append(SEARCH_WAIT - (time.monotonic() - self._unindexed_since))
        if dirty:
            waits.append(CHECKPOINT_IDLE - (time.time() - (self.last_commit or 0)))
        return max(0.0, min(waits))

    def _index_search(self, store: Store) -> None:
        """The steps committed since the last time into the full-text index, in transactions of their
        own: a step is searchable within SEARCH_WAIT, and no call's commit pays for it. What fails is
        tried again at the next batch (searching waits; capturing never does)."""
        try:
            with self.priority.raised():
                store.index_search()
            self._unindexed_since = None
            if self._search_failing:
                log.warning("stepmill: the writer updates the search index again")
                self._search_failing = False
        except Exception as exc:
            if not self._search_failing:
                log.warning(f"stepmill: the writer could not update the search index ({type(exc).__name__}: {exc});"
                            " it tries again")
                self._search_failing = True
            self._unindexed_since = time.monotonic()

    def _set_failing(self, why: str | None) -> None:
        """``failing``, and for a writer process its status file, written only when it changes."""
        if why == self.failing:
            return
        self.failing = why
        if self.status_path is not None:
            try:
                temporary = self.status_path.with_suffix(".tmp")
                temporary.write_text(json.dumps({"error": why}))
                os.replace(temporary, self.status_path)
            except OSError:
                pass  # the journal's folder is full or gone: the log has said it

    def _wait(self, timeout: float | None) -> bool:
        """Until woken (True) or ``timeout`` passed. A writer process is woken by a newline on its stdin
        and asked to flush by FLUSH; end of input (the proxy closed it, or died) stops it."""
        if self._again:
            self._again = False
            return True
        if self._stdin is None:
            if self._wake.wait(timeout):
                self._wake.clear()  # only once woken: a wake-up set after a timeout waits for the next look
                return True
            return False
        ready, _, _ = select.select([self._stdin], [], [], timeout)
        if not ready:
            return False
        told = os.read(self._stdin, 65536)
        if not told:
            self._stdin = None
            self.stop()
        elif FLUSH in told:
            self._flush_asked = True
        return True

    def _drain(self, store: Store, ingest: Ingest, journal: Journal) -> bool:
        """One batch; True if it stopped at BATCH_BYTES, so there may be more (a batch that took all
        there was needs no second, empty read). Never raises: what fails is logged, kept in ``failing``
        and tried again (the calls wait in the journal)."""
        try:
            if journal.id not in self._positions:
                self._positions[journal.id] = journal.committed(store)
            entries = list(journal.read(self._positions[journal.id], BATCH_BYTES))
            if not entries:
                return False
            self._commit_split(store, ingest, journal, entries)
        except Exception as exc:
            # Part of the batch may have committed before the failure: the position is read from the file
            # again. Entries committed twice are impossible either way (their identities are taken).
            self._positions.pop(journal.id, None)
            self._note_failure(exc)
            return False
        journal.drop_before(entries[-1][0])  # after the commits, outside them: a refused unlink is no bad entry
        if self.failing is not None:
            log.warning("stepmill: the database takes writes again")
            self._set_failing(None)
            self._stuck_waits = 0
        size = sum(len(payload) for _, payload in entries)
        self._since_checkpoint += size
        if self._since_checkpoint > CHECKPOINT_WAL_BYTES:  # roughly what the WAL grew by
            self._checkpoint(store, "PASSIVE")
        return size >= BATCH_BYTES  # as Journal.read: it stops once this much is read

    def _note_failure(self, exc: Exception) -> None:
        """Say why nothing could be committed (logged once, kept in ``failing`` for health)."""
        if isinstance(exc, StoreUnavailable):  # locked, full, read-only: the calls stay in the journal
            if self.failing is None:
                log.warning(f"stepmill: the database takes no writes now ({exc}); calls stay in the journal")
            self._set_failing(str(exc))
            return
        # An entry that could not be committed even alone, as an error step: the writer cannot get past it.
        if self.failing is None:
            log.error("stepmill: the writer cannot make progress; calls stay in the journal and it tries again",
                      exc_info=exc)
        self._set_failing(f"the writer cannot make progress: {type(exc).__name__}: {str(exc)[:500]}")
        self._stuck_waits += 1

    def _commit_split(self, store: Store, ingest: Ingest, journal: Journal, entries: list) -> None:
        """Commit ``entries``. A batch that fails for anything but the file taking no writes is halved, and
        each half committed on its own, until the entry that fails stands alone: that one is tried once more,
        then committed as one error step saying why (with its raw bytes), and the rest go on. StoreUnavailable, or an entry
        that cannot be committed even as an error step, raises: the batch waits in the journal."""
        try:
            self._commit(store, ingest, journal, entries)
        except StoreUnavailable:
            raise
        except Exception:
            if len(entries) == 1:
                try:  # once more alone: a passing failure (memory short for a moment) is no poison
                    self._commit(store, ingest, journal, entries)
                except StoreUnavailable:
                    raise
                except Exception as again:
                    poison = functools.partial(ingest.poison_entry, entries[0][1], again)
                    self._commit(store, ingest, journal, entries, [poison])
                return
            half = len(entries) // 2
            self._commit_split(store, ingest, journal, entries[:half])
            self._commit_split(store, ingest, journal, entries[half:])

    def _commit(self, store: Store, ingest: Ingest, journal: Journal, entries: list,
                writes: list[Callable[[], str]] | None = None) -> None:
        """One transaction: each entry's steps under its identity (one already committed writes nothing)
        and the journal's position past the last entry. Parsing first, outside the transaction: the write
        lock is held only for the SQL."""
        counted = ingest.unreadable
        try:
            if writes is None:
                writes = self._prepare(store, ingest, [payload for _, payload in entries])
            with self.priority.raised(), store.batch():
                for (end, _), write in zip(entries, writes):
                    with store.journal_entry(entry_identity(journal.id, end)) as fresh:
                        if fresh:
                            write()
                if ingest.unreadable > counted:  # kept with the steps, so every process and `stepmill stats` see it
                    store.set_state(UNREADABLE_KEY, str(int(store.get_state(UNREADABLE_KEY) or 0)
                                                        + ingest.unreadable - counted))
                store.set_state(state_key(journal.id), str(entries[-1][0]))
        except BaseException:
            ingest.unreadable = counted  # counted again when the entries are
            raise
        self._positions[journal.id] = entries[-1][0]
        self.committed += len(entries)
        self.last_commit = time.time()

    @staticmethod
    def _prepare(store: Store, ingest: Ingest, payloads: list[bytes]) -> list[Callable[[], str]]:
        """Each journal entry's write. An entry that is no call record is an error step that says so; a
        call's policy version is the one in effect when it started, from the file's history: the same
        answer whichever proxy process took the call, however recently the version was set, and again
        when a journal is replayed."""
        parsed: list = []
        for payload in payloads:
            try:
                parsed.append(CallRecord.from_entry(payload))
            except Exception as exc:
                parsed.append(functools.partial(ingest.unreadable_entry, f"{type(exc).__name__}: {exc}", payload))
        calls = [entry for entry in parsed if isinstance(entry, tuple)]
        for (record, _), version in zip(calls, store.policy_versions_at([record.started for record, _ in calls])):
            record.policy_version = version
        return [ingest.prepare(*entry) if isinstance(entry, tuple) else entry for entry in parsed]

    def _checkpoint(self, store: Store, mode: str) -> None:
        self._since_checkpoint = 0
        try:
            store.checkpoint(mode)  # False when a reader holds the WAL: the next batch tries again
        except Exception as exc:  # the WAL only grows until the next one: never the writer's end
            log.warning(f"stepmill: the writer could not checkpoint the WAL ({type(exc).__name__}: {exc})")


class ThreadWriter:
    """The writer in a thread of the proxy process."""

    def __init__(self, db_path: str, journal: Journal):
        self.writer = Writer(db_path, journal.folder)
        self.thread = threading.Thread(target=self.writer.run, name="stepmill-writer", daemon=True)
        self.thread.start()

    def notify(self) -> None:
        self.writer.wake()

    def flush(self) -> None:
        self.writer.flush()

    def status(self) -> dict:
        return {"alive": self.thread.is_alive(), "error": self.writer.failing}

    def close(self, timeout: float = 30.0) -> None:
        self.writer.stop()
        self.thread.join(timeout)


class ProcessWriter:
    """The writer in a process of its own: woken through its stdin, which also tells it the proxy is gone.
    One that dies (killed, out of memory) is started again at the next wake-up or flush, at most once a
    RESTART_WAIT: the journal kept its calls, and the new one commits them from where the file says."""

    def __init__(self, db_path: str, journal: Journal, priority: str = "idle"):
        self.command = [sys.executable, "-m", "stepmill.pipeline.writer", "--db", db_path, "--journal",
                        str(journal.folder), "--priority", priority, "--parent", str(os.getpid())]
        self.status_path = journal.status_path
        self.restarts = 0
        self._closing = False
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None)
        self._started = time.monotonic()

    def notify(self) -> None:
        self._tell(b"\n")

    def flush(self) -> None:
        self._tell(FLUSH + b"\n")

    def _tell(self, what: bytes) -> None:
        with self._lock:
            if self.process.poll() is not None and not self._closing:
                self._restart()
            try:
                self.process.stdin.write(what)
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the writer is gone; the journal keeps the calls for the next one

    def _restart(self) -> None:
        if time.monotonic() - self._started < RESTART_WAIT:
            return  # one that dies at once (a broken installation) is not started in a loop
        log.warning(f"stepmill: the writer process exited ({self.process.returncode}); starting another")
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self._start()
        except OSError as exc:  # no memory or no processes left for now: the next wake-up tries again
            self._started = time.monotonic()
            log.warning(f"stepmill: could not start the writer process again ({exc})")
            return
        self.restarts += 1

    def status(self) -> dict:
        """Alive while its process runs; its error, why it is behind, as the writer last wrote it; how
        often it was started again, once it was."""
        restarts = {"restarts": self.restarts} if self.restarts else {}
        code = self.process.poll()
        if code is not None:
            return {"alive": False, "error": f"the writer process exited ({code})", **restarts}
        try:
            error = json.loads(self.status_path.read_text())["error"]
        except (OSError, ValueError, KeyError, TypeError):
            error = None  # nothing written yet: it never failed
        return {"alive": True, "error": error, **restarts}

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._closing = True
        try:
            self.process.stdin.close()  # end of input: drain and exit
        except OSError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.terminate()


PRIORITIES = ("idle", "low", "normal")


class Priority:
    """The writer's CPU priority.

    idle: Linux's SCHED_IDLE; the writer parses only on a core nothing else wants, and a proxy, agent
    or engine that wakes up takes the core at once. Its transactions run at nice 10 instead where the
    process may switch back (root, CAP_SYS_NICE, or RLIMIT_NICE ≥ 10), so other writers never wait on
    a lock held by a starved process. low: nice 10 throughout. normal: as the proxy.
    """

    def __init__(self, name: str):
        self.name = name
        self.idle = False

    def apply(self) -> None:
        """In the writer process, before it runs (the calling thread: the writer runs in it)."""
        try:
            if self.name in ("idle", "low"):
                os.nice(10)
            if self.name == "idle" and hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                self.idle = True
        except OSError as exc:
            log.warning(f"stepmill: the writer keeps its CPU priority ({exc})")

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        """Around a transaction: out of SCHED_IDLE while the write lock is held, where permitted."""
        if not self.idle:
            yield
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            self.idle = False  # not permitted here: the transaction runs at idle priority, as the parsing
            yield
            return
        try:
            yield
        finally:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _serve_process(db_path: str, folder: Path, priority: str, parent: int) -> None:
    # The proxy says when to stop (end of stdin, also when it dies); a Ctrl-C reaching the whole
    # process group must not end the writer before it has committed what the proxy hands over last.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with_parent, args=(parent,), name="stepmill-orphan-watch", daemon=True).start()
    chosen = Priority(priority)
    chosen.apply()
    writer = Writer(db_path, folder, chosen, stdin=sys.stdin.fileno())
    writer.status_path = writer.journal.status_path
    writer.run()


def _end_with_parent(parent: int) -> None:
    """A writer process never outlives its proxy: once the parent is gone (killed, or its pipe kept
    open by something else; ``parent`` is the pid the proxy gave, since it may be gone before this
    process has even imported what it runs) the writer has ORPHAN_GRACE seconds to commit what it can, then it exits
    whatever it is doing (a locked file, an entry it cannot get past). What it left in the journal is
    replayed by the next writer of the file."""
    while os.getppid() == parent:
        time.sleep(0.5)
    time.sleep(ORPHAN_GRACE)
    logging.getLogger("stepmill").warning("stepmill: the writer's proxy is gone; the writer exits, the journal "
                                          "keeps what it did not commit")
    os._exit(0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="stepmill's writer: journal → SQLite")
    parser.add_argument("--db", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--priority", choices=PRIORITIES, default="idle")
    parser.add_argument("--parent", type=int, default=None, help="the proxy's pid (default: this process's parent)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    journal = Journal(Path(args.journal))
    journal.try_lock(shared=True)  # beside the proxy's own: the journal is no orphan while either lives
    _serve_process(args.db, Path(args.journal), args.priority, args.parent or os.getppid())


if __name__ == "__main__":
    main()
