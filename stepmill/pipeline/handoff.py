"""The handoff: finished calls go from the event loop to the journal.

    event loop ──submit(record, blobs)──▶ handoff thread ──append──▶ journal ──▶ writer (writer.py)
      (references to bytes only)           (cleans, one write() per batch)

``submit`` runs on the event loop and only queues references. Everything else here runs off the
loop, on the handoff thread: bodies are cut to ``max_body``, decoded and redacted (secrets never
reach the disk, the journal included), then appended to the journal, which survives a kill -9 of
the proxy. While the journal refuses appends (a full disk), calls wait in memory, up to a bound.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time

from stepmill import tags as tagging
from stepmill.protocols.streams import decode_kept
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.journal import Journal
from stepmill.pipeline.redaction import redact_bytes, redact_text

log = logging.getLogger("stepmill")

# Seconds a woken writer gathers calls before it commits them in one transaction (a barrier's flush
# and a trajectory's `complete` end the wait at once); the handoff wakes it at most this often. A call
# is durable once in the journal, long before; the window is how stale the file may be for readers.
# Each wake-up of the writer costs about 2 ms of CPU beyond its calls' own (a commit, caches gone
# cold in the sleep), so at one call in flight (ten a second) a window of 1 s commits ten calls a
# wake-up where 0.25 s committed two or three: 1.29 against 1.89 ms of the writer's CPU per call
# (bench/commit_bench.py).
COMMIT_WINDOW = 1.0
# Under load, a pass starts at most once per GATHER seconds: the calls that ended meanwhile are cleaned
# and appended together. Each pass costs the thread a cold start (its caches taken by the event loop) and
# GIL handovers with the loop, whatever it carries: at 16 streams in flight the thread spent 0.39 ms a
# call at one pass per call, 0.23 ms at one pass per 50 ms (bench/cpu_by_thread.py). A call that ends
# alone (the last pass began longer ago) is appended at once; a flush (a barrier) and close cut the wait.
GATHER = 0.05
# What a finished call waits for before the journal: "gathered" (the default) lets it join the calls ending
# within GATHER; "call" journals it in the next pass, at once (about 1 ms), for more CPU under load.
DURABILITY = ("gathered", "call")
RETRY_WAIT = 0.5  # after the journal refused an append
MEMORY_LIMIT = 256 * 1024 * 1024  # calls waiting for the journal (a full disk) at most, in bytes
CLEAN_FAILED = "stepmill could not clean this call for recording"


def redact_record(record: CallRecord) -> CallRecord:
    """The record with its header values and error text cleaned (their names are allowlisted already,
    on the loop): a copy where anything was taken out, else the record given (never changed here)."""
    changes: dict = {}
    if record.call.headers:
        headers = {name: redact_text(value) for name, value in record.call.headers.items()}
        if headers != record.call.headers:
            changes["call"] = dataclasses.replace(record.call, headers=headers)
    if record.error:
        error = redact_text(record.error)
        if error != record.error:
            changes["error"] = error
    return dataclasses.replace(record, **changes) if changes else record


class Handoff:
    """In the proxy: takes finished calls from the event loop and appends them to the journal."""

    def __init__(self, journal: Journal, notify, memory_limit: int = MEMORY_LIMIT, durability: str = "gathered"):
        self.journal = journal
        self.gather = GATHER if durability == "gathered" else 0.0
        self.notify = notify  # called after appends: wakes the writer
        self.memory_limit = memory_limit
        self.queue: collections.deque = collections.deque()
        self._bound = threading.Lock()  # held for every read and write of memory and dropped
        self.memory = 0  # bytes waiting: added on the loop, taken off on the handoff thread
        self.dropped = 0  # calls not kept: the journal refused appends and memory was full
        self.appended = 0
        self.not_cleaned = 0  # calls journaled without their bodies: cleaning them failed
        # why calls wait in memory now: the journal refuses appends (a full disk), or a pass failed
        self.behind: str | None = None
        self.delays: collections.deque = collections.deque(maxlen=1000)  # call end → in the journal, seconds
        self._notified = 0.0
        self._passed = 0.0  # when the last pass began (time.monotonic)
        self._wake = threading.Event()
        self._hurry = threading.Event()  # set: the pass under way gathers no longer
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="stepmill-handoff", daemon=True)
        self.thread.start()

    def submit(self, record: CallRecord, blobs: list[bytes]) -> None:
        """On the event loop: O(1), no I/O (but a log line for a call dropped over the memory bound)."""
        limit = record.max_body or None  # what is kept of a larger body: never dropped for its size
        size = sum(min(len(b), limit) if limit else len(b) for b in blobs)
        with self._bound:
            over = self.memory + size > self.memory_limit
            if over:  # the journal has refused appends for long: memory is the last bound
                self.dropped += 1
                dropped, waiting = self.dropped, self.memory
            else:
                self.memory += size
        if over:
            if dropped == 1 or dropped % 100 == 0:  # a full disk drops many: the first, then every 100th
                log.error(f"stepmill: dropped a call to {record.call.host}{record.call.path} ({dropped} so far): "
                          f"the journal takes no appends ({self.behind}) and {waiting} bytes wait in memory already")
            return
        self.queue.append((record, blobs, size))
        self._wake.set()

    def _run(self) -> None:
        while True:
            try:
                if self._pass():
                    return
            except Exception as exc:  # never ends silently: every later call would stay in memory only
                log.exception("stepmill: the handoff failed; it goes on")
                self.behind = f"{type(exc).__name__}: {exc}"  # health says why calls wait; cleared by an append
                time.sleep(RETRY_WAIT)

    def _pass(self) -> bool:
        """One wake-up's work; True once stopped with nothing left."""
        self._wake.wait(RETRY_WAIT if self.behind else None)
        gather = self._passed + self.gather - time.monotonic()
        if gather > 0:
            self._hurry.wait(gather)  # calls ending meanwhile join this pass
        self._hurry.clear()
        self._wake.clear()
        self._passed = time.monotonic()
        while self.queue:
            batch = list(itertools.islice(self.queue, 256))  # the loop only appends on the right
            # Secrets never reach the disk, the journal included (a few ms per MB, off the loop).
            data, not_cleaned = [], 0
            for record, blobs, _ in batch:
                parts, cleaned = self._entry(record, blobs)
                data += parts
                not_cleaned += not cleaned
            try:
                self.journal.append(data)  # one write() for the batch
            except OSError as exc:
                if self.behind is None:
                    log.warning(f"stepmill: the journal takes no appends ({exc}); calls wait in memory")
                self.behind = str(exc)
                break
            if self.behind is not None:
                log.warning("stepmill: calls reach the journal again")
                self.behind = None
            now = time.time()
            for record, _, size in batch:
                self.queue.popleft()
                with self._bound:
                    self.memory -= size
                self.delays.append(now - (record.ended or now))
            self.appended += len(batch)
            self.not_cleaned += not_cleaned  # counted once journaled: a refused batch is cleaned again
            # One wake-up per COMMIT_WINDOW is enough: a woken writer waits that long before it reads
            # the journal, so it also sees what was appended since.
            if time.monotonic() - self._notified >= COMMIT_WINDOW or self._stop:
                self._notified = time.monotonic()
                self.notify()
        return self._stop and not self.queue

    def _entry(self, record: CallRecord, blobs: list) -> tuple[list, bool]:
        """The journal entry of one call and whether it was cleaned (else it is kept without its bodies);
        never raises: one call cannot hold up the ones after it."""
        try:
            cleaned, kept = self.clean(record, blobs)
            return cleaned.entry_parts(kept), True
        except Exception as exc:
            log.exception(f"stepmill: could not clean a call to {record.call.host}{record.call.path}; "
                          "kept without its bodies")
            return self.kept_without_bodies(record, blobs, exc), False

    @staticmethod
    def kept_without_bodies(record: CallRecord, blobs: list, exc: Exception) -> list:
        """The entry of a call that could not be cleaned: as it came but without its bodies (nothing
        unredacted reaches the disk), its record saying why; the writer stores it as an error step. Should
        even its record not be written (a header that is no JSON), only who made it and where it went."""
        note = f"{CLEAN_FAILED} ({type(exc).__name__}); its bodies were not kept"
        try:
            # The bodies' problems are the note: the step's error says why, not "the body is no JSON".
            return redact_record(dataclasses.replace(
                record, error=f"{note}; {record.error}" if record.error else note,
                request_problem=note, response_problem=note,
                notes=list(record.notes) + [note])).entry_parts([b"" for _ in blobs])
        except Exception:
            call = record.call
            try:  # who made it, as the flow's tags say (three strings, which JSON always takes)
                tags = tagging.Tags(*(None if value is None else str(value) for value in
                                      (call.tags.trajectory_id, call.tags.group_id, call.tags.channel)))
            except Exception:
                tags = tagging.Tags()
            return CallRecord(kind="failure", call=Call(api=str(call.api), host=str(call.host), path=str(call.path),
                                                        tags=tags),
                              started=record.started if isinstance(record.started, (int, float)) else 0.0,
                              error=note).entry_parts([b"", b""])

    @staticmethod
    def clean(record: CallRecord, blobs: list) -> tuple[CallRecord, list[bytes]]:
        """Off the loop: what the journal gets of a call. Bodies are cut to ``max_body``, decoded (secrets
        in a gzip body are only found decoded) and redacted; the record then says they are plain (no
        encoding), so the writer never decodes them again. The call's own record stays as it came: a
        batch the journal refused is cleaned again from it."""
        if record.kind == "websocket":  # frames: no content-encoding, each bounded by mitmproxy
            return redact_record(record), [redact_bytes(blob) for blob in blobs]
        limit = record.max_body or None
        changes: dict = {}
        cuts, out = [], []
        for index, blob in enumerate(blobs):
            if index > 1:
                out.append(redact_bytes(blob))
                continue
            role, peer = ("request", "upstream") if index == 0 else ("response", "client")
            received = max(len(blob), record.received or 0) if index == 1 else len(blob)
            if limit and len(blob) > limit:
                blob = blob[:limit]
            stream = index == 1 and record.kind == "sse"
            blob, marks, problem, cut_decoded = decode_kept(
                blob, getattr(record, f"{role}_encoding"), record.marks if stream else None, limit)
            changes[f"{role}_encoding"] = None  # plain from here on
            if stream:
                changes["marks"] = marks
            if problem:
                changes[f"{role}_problem"] = problem
            if received > (limit or received):
                cuts.append(f"{role} truncated for recording: stepmill kept the first {limit} of its {received} "
                            f"bytes (stepmill_max_body); the {peer} got every byte")
            elif cut_decoded:
                cuts.append(f"{role} truncated for recording: stepmill kept the first {limit} bytes of its "
                            f"decoded body (stepmill_max_body); the {peer} got every byte")
            out.append(redact_bytes(blob))
        if cuts:
            changes["truncated"] = cuts
            changes["notes"] = list(record.notes) + cuts
        return redact_record(dataclasses.replace(record, **changes)), out

    def hurry(self) -> None:
        """Someone waits for every call so far to be journaled (a barrier): no gathering now. Cheap, for
        the event loop."""
        self._hurry.set()
        self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        self._stop = True
        self.hurry()
        self.thread.join(timeout)

    def counts(self) -> dict:
        """Calls journaled, dropped and journaled without bodies so far (cheap: the loop may ask)."""
        with self._bound:
            dropped = self.dropped
        return {"journaled": self.appended, "dropped": dropped, "not_cleaned": self.not_cleaned}

    def status(self) -> dict:
        delays = sorted(self.delays)
        with self._bound:
            memory = self.memory
        return {"in_memory": len(self.queue), "in_memory_bytes": memory, **self.counts(),
                "journal_error": self.behind,
                "journal_delay_ms": {"p50": round(delays[len(delays) // 2] * 1000, 3),
                                     "p99": round(delays[int(len(delays) * 0.99)] * 1000, 3),
                                     "max": round(delays[-1] * 1000, 3)} if delays else None}
