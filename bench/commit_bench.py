"""What committing a captured call costs the writer, one call in flight: the file's layout and the
commit window, side by side in one run.

One agent streaming one call at a time (20 chunks, about 0.1 s a call, as the shared proxy benchmark's
c=1 cell) wakes the writer once per commit window; each wake-up finds its caches cold and costs about
as much CPU again as the work it then does. A journal of such calls, made once by the real handoff
(cleaning, redaction, the entry format), is replayed through the real writer (``Writer._drain``: parse,
link, insert, commit, journal position) into a fresh file per configuration, the calls spaced as they
come, rounds interleaved so machine noise hits every configuration alike:

- **before**: 16 KiB pages, the full-text index written in each commit (the old insert trigger), a
  commit every 0.1 s;
- **8 KiB pages** (now; 4 KiB beside it): each commit writes half (a quarter) of the bytes for the
  same pages; the file is 2% (22%) larger for rows of a few KB;
- **+ index after commit**: steps enter the full-text index in batches (``store/search.py``);
- **+ 0.25 s window**: a wake-up every 0.25 s, two or three calls a commit;
- **+ 1 s window** (now): a wake-up a second, about ten calls a commit.

The figure is the writer's CPU per call (its thread's time), whose cost lands on the machine that runs
the proxy.

    .venv/bin/python -m bench.commit_bench                 # about 2 minutes
    .venv/bin/python -m bench.commit_bench --calls 40 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import stepmill.pipeline.writer as writer_module
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.handoff import Handoff
from stepmill.pipeline.journal import Journal
from stepmill.pipeline.writer import SEARCH_WAIT, Writer
from stepmill.store import Store
from stepmill.store.migrations import SEARCH_MARK

CALL_SECONDS = 0.105  # one streamed call of the shared benchmark's c=1 cell, end to end
# (name, page size, full-text index in each commit, commit window in seconds)
CONFIGS = [("before", 16384, True, 0.1), ("8 KiB pages", 8192, True, 0.1),
           ("+ index after commit", 8192, False, 0.1), ("+ 0.25 s window", 8192, False, 0.25),
           ("+ 1 s window (now)", 8192, False, 1.0), ("the same with 4 KiB pages", 4096, False, 1.0)]
OLD_INSERT_TRIGGER = f"""CREATE TRIGGER steps_ai AFTER INSERT ON steps BEGIN
    INSERT INTO steps_fts (rowid, messages_suffix, completion) VALUES (new.rowid, new.messages_suffix, new.completion);
    UPDATE state SET value = CAST(new.rowid AS TEXT) WHERE key = '{SEARCH_MARK}';
END"""


def stream(call: int) -> tuple[bytes, bytes, list]:
    """A chat completions request and its 20-event SSE answer, as the lean upstream sends them."""
    request = json.dumps({"model": "bench", "stream": True, "messages": [
        {"role": "user", "content": f"benchmark call {call}: say something short"}]}).encode()
    base = {"id": f"chatcmpl-{call}", "object": "chat.completion.chunk", "created": 1, "model": "bench"}
    events = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    events += [dict(base, choices=[{"index": 0, "delta": {"content": f" tok{k}"}, "finish_reason": None}])
               for k in range(1, 19)]
    events.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    body = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n"
    now = time.time()
    return request, body, [(len(body), now)]


def make_journal(folder: Path, calls: int) -> Path:
    """``calls`` streamed calls appended by the real handoff thread; the journal's folder."""
    journal = Journal.create(str(folder / "source.db"))
    handoff = Handoff(journal, lambda: None)
    for call in range(calls):
        request, body, marks = stream(call)
        record = CallRecord(kind="sse", call=Call("openai.chat", "api.openai.com", "/v1/chat/completions",
                                                  headers={"user-agent": "bench"}, client_conn=f"c{call}"),
                            started=time.time(), ended=time.time(), http_status=200, marks=marks)
        handoff.submit(record, [request, body])
    handoff.close()
    journal.release()
    return journal.folder


def replay(folder: Path, source: Path, page_size: int, index_in_commit: bool, window: float) -> float:
    """The journal committed into a new file, calls spaced CALL_SECONDS apart, a commit per window;
    the writer's CPU seconds per call."""
    path = folder / f"replay-{time.monotonic_ns()}.db"
    sqlite3.connect(path).executescript(f"PRAGMA page_size = {page_size}; PRAGMA journal_mode = WAL;")
    store = Store(str(path))
    if index_in_commit:
        store.db.conn.execute(OLD_INSERT_TRIGGER)
    store.close()
    writer = Writer(str(path), source)
    store, ingest = writer._start()
    per_commit = max(1, round(window / CALL_SECONDS))
    sizes = [len(payload) for _, payload in writer.journal.read(writer.journal.committed(store), 1 << 40)]
    writer_module.BATCH_BYTES = int((per_commit - 0.5) * statistics.mean(sizes))  # read that many calls a batch
    spent, calls, unindexed = 0.0, 0, 0.0
    try:
        while True:
            time.sleep(CALL_SECONDS * per_commit)  # the calls of one window arrive; the writer sleeps meanwhile
            started = time.thread_time()
            before = writer.committed
            writer._drain(store, ingest, writer.journal)
            done = writer.committed == before
            unindexed += CALL_SECONDS * per_commit
            if not index_in_commit and (unindexed >= SEARCH_WAIT or done):
                store.index_search()  # as the writer: once a SEARCH_WAIT while calls come
                unindexed = 0.0
            spent += time.thread_time() - started
            if done:
                break
            calls += writer.committed - before
    finally:
        store.close()
        writer.journal.release()
    assert calls == len(sizes), (calls, len(sizes))
    return spent / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60, help="calls replayed per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stepmill-commit-bench-"))
    results: dict[str, list[float]] = {name: [] for name, *_ in CONFIGS}
    for round_ in range(args.rounds):
        order = CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]
        for name, page_size, index_in_commit, window in order:
            source = make_journal(work / f"{round_}-{len(results[name])}-{page_size}-{window}", args.calls)
            results[name].append(replay(work, source, page_size, index_in_commit, window))
    before = statistics.median(results["before"])
    print(f"\nthe writer's CPU per streamed call, one call in flight ({args.calls} calls × {args.rounds} rounds, "
          "medians)\n")
    print("| configuration | ms per call | × before |")
    print("|---|---|---|")
    for name, *_ in CONFIGS:
        median = statistics.median(results[name])
        print(f"| {name} | {median * 1000:.2f} | {median / before:.2f} |")
    print("\nreproduce: .venv/bin/python -m bench.commit_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


if __name__ == "__main__":
    main()
