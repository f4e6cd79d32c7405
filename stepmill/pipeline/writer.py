"""The writer: finished calls go from the event loop to the journal, and from the journal to SQLite.

    event loop ──submit()──▶ Handoff thread ──append──▶ journal ──▶ Writer ──batch──▶ SQLite
      (bytes only)             (one write() per call)     (on disk)   (thread, or its own process)

The event loop only hands over references to bytes it already has. The handoff thread
appends each call to the journal (secrets redacted first), which survives a kill -9 of the
proxy. The writer parses,
links and writes in batches, one transaction each, recording how far in the journal it got in
that same transaction; it checkpoints the WAL itself. A locked database or a full disk only
makes the journal grow; the calls are committed when the file takes writes again, or by the
next writer that starts. Run as a process (``python -m stepmill.pipeline.writer``), the writer
gets a core of its own and its parsing never holds the proxy's GIL.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import logging
import os
import select
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from stepmill.store.db import Store
from stepmill.pipeline.journal import Journal, decode_entry, entry_parts, state_key

from stepmill.pipeline.ingest import Ingest
from stepmill.pipeline.recording import EnvironmentFailure
from stepmill.pipeline.redaction import redact_bytes, redact_text
from stepmill.addon.stream_tap import decode_kept

log = logging.getLogger("stepmill")

BATCH_BYTES = 8 * 1024 * 1024  # journal bytes per transaction at most
BATCH_WAIT = 0.1  # seconds the writer waits for more calls before committing what it has
CHECKPOINT_WAL_BYTES = 32 * 1024 * 1024  # the writer checkpoints after committing this much, or when idle
CHECKPOINT_IDLE = 5.0  # seconds without calls after which the WAL is checkpointed
RETRY_WAIT = 0.5  # after a locked database or a full disk
MEMORY_LIMIT = 256 * 1024 * 1024  # calls waiting for the journal (a full disk) at most, in bytes


def redact_header(header: dict) -> dict:
    """The entry's header with its header values and error text cleaned (their names are allowlisted
    already, on the loop)."""
    if header.get("headers"):
        header["headers"] = {name: redact_text(value) for name, value in header["headers"].items()}
    if header.get("error"):
        header["error"] = redact_text(header["error"])
    return header


class Handoff:
    """In the proxy: takes finished calls from the event loop and appends them to the journal."""

    def __init__(self, journal: Journal, notify, memory_limit: int = MEMORY_LIMIT):
        self.journal = journal
        self.notify = notify  # called after appends: wakes the writer
        self.memory_limit = memory_limit
        self.queue: collections.deque = collections.deque()
        self.memory = 0
        self.dropped = 0
        self.appended = 0
        self.failing: str | None = None  # why the journal does not take appends now
        self.delays: collections.deque = collections.deque(maxlen=1000)  # call end → in the journal, seconds
        self._notified = 0.0
        self._wake = threading.Event()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="stepmill-handoff", daemon=True)
        self.thread.start()

    def submit(self, header: dict, blobs: list[bytes]) -> None:
        """On the event loop: O(1), no I/O."""
        limit = header.get("max_body") or None  # what is kept of a larger body: never dropped for its size
        size = sum(min(len(b), limit) if limit else len(b) for b in blobs)
        if self.memory + size > self.memory_limit:
            self.dropped += 1  # the journal has refused appends for long: memory is the last bound
            return
        self.memory += size
        self.queue.append((header, blobs, size))
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(RETRY_WAIT if self.failing else None)
            self._wake.clear()
            while self.queue:
                batch = list(itertools.islice(self.queue, 256))  # the loop only appends on the right
                # Secrets never reach the disk, the journal included (a few ms per MB, off the loop).
                data = [part for header, blobs, _ in batch for part in entry_parts(*self.clean(header, blobs))]
                try:
                    self.journal.append(data)  # one write() for the batch
                except OSError as exc:
                    if self.failing is None:
                        log.warning(f"stepmill: the journal takes no appends ({exc}); calls wait in memory")
                    self.failing = str(exc)
                    break
                if self.failing is not None:
                    log.warning("stepmill: the journal takes appends again")
                    self.failing = None
                now = time.time()
                for header, _, size in batch:
                    self.queue.popleft()
                    self.memory -= size
                    self.delays.append(now - (header.get("ended") or now))
                self.appended += len(batch)
                # One wake-up per BATCH_WAIT is enough: a woken writer waits that long before it reads
                # the journal, so it also sees what was appended since.
                if time.monotonic() - self._notified >= BATCH_WAIT or self._stop:
                    self._notified = time.monotonic()
                    self.notify()
            if self._stop and not self.queue:
                return

    @staticmethod
    def clean(header: dict, blobs: list) -> tuple[dict, list[bytes]]:
        """Off the loop: what the journal gets of a call. Bodies are cut to ``max_body``, decoded (secrets
        in a gzip body are only found decoded) and redacted; the header then says they are plain (no
        encoding), so the writer never decodes them again. The call's own header stays as it came: a
        batch the journal refused is cleaned again from it."""
        header = dict(header)
        if header.get("kind") == "websocket":  # frames: no content-encoding, each bounded by mitmproxy
            return redact_header(header), [redact_bytes(blob) for blob in blobs]
        limit = header.get("max_body") or None
        cuts, out = [], []
        for index, blob in enumerate(blobs):
            if index > 1:
                out.append(redact_bytes(blob))
                continue
            role, peer = ("request", "upstream") if index == 0 else ("response", "client")
            received = max(len(blob), header.get("received") or 0) if index == 1 else len(blob)
            if limit and len(blob) > limit:
                blob = blob[:limit]
            stream = index == 1 and header.get("kind") == "sse"
            blob, marks, problem, cut_decoded = decode_kept(
                blob, header.get(f"{role}_encoding"), header.get("marks") if stream else None, limit)
            header[f"{role}_encoding"] = None  # plain from here on
            if stream:
                header["marks"] = marks
            if problem:
                header[f"{role}_problem"] = problem
            if received > (limit or received):
                cuts.append(f"{role} truncated for recording: stepmill kept the first {limit} of its {received} "
                            f"bytes (stepmill_max_body); the {peer} got every byte")
            elif cut_decoded:
                cuts.append(f"{role} truncated for recording: stepmill kept the first {limit} bytes of its "
                            f"decoded body (stepmill_max_body); the {peer} got every byte")
            out.append(redact_bytes(blob))
        if cuts:
            header["truncated"] = cuts
            header["notes"] = list(header.get("notes") or []) + cuts
        return redact_header(header), out

    def close(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout)

    def status(self) -> dict:
        delays = sorted(self.delays)
        return {"in_memory": len(self.queue), "in_memory_bytes": self.memory, "dropped": self.dropped,
                "journaled": self.appended, "journal_error": self.failing,
                "journal_delay_ms": {"p50": round(delays[len(delays) // 2] * 1000, 3),
                                     "p99": round(delays[int(len(delays) * 0.99)] * 1000, 3),
                                     "max": round(delays[-1] * 1000, 3)} if delays else None}


class Writer:
    """Commits journal entries to SQLite in batches; replays journals left by writers that died."""

    def __init__(self, db_path: str, journal_folder: Path, priority: Priority | None = None):
        self.db_path = db_path
        self.journal = Journal(journal_folder)
        self.priority = priority or Priority("normal")
        self._wake = threading.Event()
        self._stop = False
        self.committed = 0
        self.last_commit: float | None = None
        self.failing: str | None = None
        self._since_checkpoint = 0

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def run(self) -> None:
        store = Store(self.db_path)
        store.db.conn.execute("PRAGMA wal_autocheckpoint = 0")  # checkpoints happen here, between batches
        ingest = Ingest(store)
        orphans = [j for j in Journal.orphans(self.db_path) if j.folder != self.journal.folder]
        for orphan in orphans:
            log.info(f"stepmill: replaying the journal {orphan.folder} left by a writer that stopped")
            while self._drain(store, ingest, orphan):
                pass
            orphan.retire(store)
        dirty = False
        while True:
            woken = self._wake.wait(RETRY_WAIT if self.failing else (CHECKPOINT_IDLE if dirty else None))
            self._wake.clear()
            if not woken and dirty and not self.failing:
                self._checkpoint(store, "PASSIVE")  # idle: a good moment to fold the WAL into the file
                dirty = False
                continue
            stopping = self._stop
            time.sleep(BATCH_WAIT if not stopping else 0)  # let a burst of calls share one transaction
            while self._drain(store, ingest, self.journal):
                dirty = True
            if stopping and not self.failing:
                break
        self._checkpoint(store, "TRUNCATE")
        store.close()

    def _drain(self, store: Store, ingest: Ingest, journal: Journal) -> bool:
        """One batch; True if there may be more."""
        try:
            position = journal.committed(store)
            entries = list(journal.read(position, BATCH_BYTES))
            if not entries:
                return False
            # Parsing first, outside the transaction: the write lock is held only for the SQL.
            writes = [ingest.prepare(*decode_entry(payload)) for _, payload in entries]
            with self.priority.raised(), store.batch() as conn:
                for write in writes:
                    write()
                conn.execute("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)",
                             [state_key(journal.id), str(entries[-1][0])])
        except (sqlite3.OperationalError, EnvironmentFailure) as exc:
            if self.failing is None:
                log.warning(f"stepmill: the database takes no writes now ({exc}); calls stay in the journal")
            self.failing = str(exc)
            return False
        if self.failing is not None:
            log.warning("stepmill: the database takes writes again")
            self.failing = None
        self.committed += len(entries)
        self.last_commit = time.time()
        journal.drop_before(entries[-1][0])
        self._since_checkpoint += sum(len(payload) for _, payload in entries)
        if self._since_checkpoint > CHECKPOINT_WAL_BYTES:  # roughly what the WAL grew by
            self._checkpoint(store, "PASSIVE")
        return True

    def _checkpoint(self, store: Store, mode: str) -> None:
        self._since_checkpoint = 0
        try:
            store.db.conn.execute(f"PRAGMA wal_checkpoint({mode})")
        except sqlite3.OperationalError:
            pass  # a reader holds the WAL; the next batch tries again


class ThreadWriter:
    """The writer in a thread of the proxy process."""

    def __init__(self, db_path: str, journal: Journal):
        self.writer = Writer(db_path, journal.folder)
        self.thread = threading.Thread(target=self.writer.run, name="stepmill-writer", daemon=True)
        self.thread.start()

    def notify(self) -> None:
        self.writer.wake()

    def close(self, timeout: float = 30.0) -> None:
        self.writer.stop()
        self.thread.join(timeout)


class ProcessWriter:
    """The writer in a process of its own: woken through its stdin, which also tells it the proxy is gone."""

    def __init__(self, db_path: str, journal: Journal, priority: str = "idle"):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stepmill.pipeline.writer", "--db", db_path, "--journal", str(journal.folder),
             "--priority", priority],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None)
        self._lock = threading.Lock()

    def notify(self) -> None:
        with self._lock:
            try:
                self.process.stdin.write(b"\n")
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the writer is gone; the journal keeps the calls for the next one

    def close(self, timeout: float = 30.0) -> None:
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
        """In the writer process, before its threads start (they inherit it)."""
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


def _serve_process(db_path: str, folder: Path, priority: str) -> None:
    chosen = Priority(priority)
    chosen.apply()
    writer = Writer(db_path, folder, chosen)
    thread = threading.Thread(target=writer.run, name="stepmill-writer", daemon=False)
    thread.start()
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([stdin], [], [], 1.0)
        if ready:
            data = os.read(stdin.fileno(), 65536)
            if not data:
                break  # the proxy closed the pipe, or died
        writer.wake()
    writer.stop()
    thread.join()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="stepmill's writer: journal → SQLite")
    parser.add_argument("--db", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--priority", choices=PRIORITIES, default="idle")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    journal = Journal(Path(args.journal))
    journal.try_lock(shared=True)  # beside the proxy's own: the journal is no orphan while either lives
    _serve_process(args.db, Path(args.journal), args.priority)


if __name__ == "__main__":
    main()
