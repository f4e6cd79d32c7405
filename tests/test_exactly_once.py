"""Every finished call is stored exactly once, whatever arrives beside it and whatever fails after it.

- Through a real ``stepmill proxy``: request bodies nested hundreds to tens of thousands deep, beside 16
  honest clients streaming and not; every honest call is one step, every hostile call is one step.
- With the real pipeline on a real journal and SQLite file: a batch that fails after its COMMIT (the
  writer's belief about its position goes stale) and a journal replayed from its start write nothing
  twice (each entry's identity is a key of the store); a poison entry is isolated by halving the batch
  and kept as one error step with its reason and raw bytes, and the entries around it are committed.
- A writer process never outlives its proxy: killed while its writer is stuck on a locked file, the
  writer is gone within seconds and the file does not grow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import sqlite3
import ssl
import time

import httpx2
import openai
import pytest

from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.ingest import Ingest
from stepmill.pipeline.journal import Journal, Position, state_key
from stepmill.pipeline.service import Pipeline
from stepmill.pipeline.writer import ORPHAN_GRACE, Writer
from stepmill.store import Store

from .conftest import start_proxy, stop_proxy, wait_until

REPLY = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


def _texts(store: Store) -> list[str]:
    """The user text of every step, one entry per step (a step stored twice counts twice)."""
    return [m["content"] for s in store.iter_steps() for m in s["messages"] if isinstance(m.get("content"), str)]


def _nested(depth: int, marker: str) -> bytes:
    """A chat request whose message content is ``depth`` lists deep around ``marker``."""
    content = "[" * depth + json.dumps(marker) + "]" * depth
    return (b'{"model": "gpt-test", "messages": [{"role": "user", "content": ' + content.encode() + b'}]}')


def test_deep_bodies_beside_16_honest_streams_are_each_stored_once(tmp_path, upstream, marker):
    proxy = start_proxy(tmp_path, upstream)
    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    honest = [f"honest {marker} {i} {j}" for i in range(16) for j in range(3)]
    hostile = {depth: f"deep-{depth}-{marker}" for depth in (100, 980, 3000, 100_000)}

    def honest_client(i: int) -> None:
        http = httpx2.Client(proxy=proxy.url, verify=verify, timeout=60)
        client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http, max_retries=0)
        for j in range(3):
            reply = client.chat.completions.create(model="gpt-test", stream=j != 1,
                                                   messages=[{"role": "user", "content": f"honest {marker} {i} {j}"}])
            if j != 1:
                for _ in reply:
                    pass

    def hostile_client(depth: int) -> int:
        answer = httpx2.post(f"http://127.0.0.1:{proxy.reverse_port}/v1/chat/completions", timeout=60,
                             content=_nested(depth, hostile[depth]), headers={"Content-Type": "application/json"})
        return answer.status_code

    try:
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            honest_runs = [pool.submit(honest_client, i) for i in range(16)]
            statuses = list(pool.map(hostile_client, hostile))
            for run in honest_runs:
                run.result()
        assert all(isinstance(code, int) for code in statuses)
        after = f"after {marker}"
        httpx2.post(f"http://127.0.0.1:{proxy.reverse_port}/v1/chat/completions", timeout=60,
                    json={"model": "gpt-test", "messages": [{"role": "user", "content": after}]})
        store = proxy.store()

        calls = len(honest) + 1 + len(hostile)

        def every_call_stored() -> bool:
            texts = _texts(store)
            return all(t in texts for t in honest + [after]) and _count(store) >= calls

        wait_until(every_call_stored, timeout=60, what="every honest and hostile call stored")
        time.sleep(2)  # a writer that stores calls again would do it within its next batches
        texts = _texts(store)
        doubled = {t: texts.count(t) for t in honest + [after] if texts.count(t) != 1}
        assert not doubled, f"honest calls not stored exactly once (text: times stored): {doubled}"
        for depth, mark in hostile.items():  # those the parser refuses keep their raw bytes, and so their marker
            rows = _hostile_rows(store, mark)
            assert len(rows) <= 1, f"the body nested {depth} deep was stored {len(rows)} times, not once: {rows}"
        assert _count(store) == calls, f"{_count(store)} steps for {calls} calls"
        health = proxy.client().health()["capture"]
        assert health["threads"]["writer"]["error"] is None, health
        store.close()
    finally:
        stop_proxy(proxy)


def _count(store: Store) -> int:
    return store.query("SELECT count(*) AS n FROM steps")[0]["n"]


def _hostile_rows(store: Store, mark: str) -> list[dict]:
    """The steps that hold ``mark`` in their raw request or their conversation."""
    return store.query("SELECT status, error FROM steps WHERE instr(CAST(raw_request AS BLOB), ?) > 0 "
                       "OR instr(messages_suffix, ?) > 0", [mark.encode(), mark])


def _append_calls(journal: Journal, texts: list[str]) -> None:
    """Finished chat calls appended to ``journal`` as the handoff appends them."""
    from stepmill.pipeline.journal import entry_parts

    for text in texts:
        record = CallRecord(kind="http", call=Call("openai.chat", "h", "/v1/chat/completions"),
                            started=time.time(), ended=time.time(), http_status=200)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
        journal.append(entry_parts(record.to_header(), [body, json.dumps(REPLY).encode()]))


def _drain(db: str, journal: Journal) -> Writer:
    """A writer over ``journal`` that commits everything it can, in this thread, and stops."""
    writer = Writer(db, journal.folder)
    store = Store(db)
    ingest = Ingest(store)
    for _ in range(50):
        if not writer._drain(store, ingest, journal) and not journal.backlog(journal.committed(store)):
            break
    store.close()
    return writer


def test_a_batch_that_fails_after_its_commit_and_a_replay_from_the_start_store_nothing_twice(tmp_path, monkeypatch):
    """The issue's mechanism: what a batch cached was published after COMMIT and raised there, so the writer
    kept its old position and committed the same entries again, and again. Now each entry's identity is a
    key of the store: a retry, or a whole journal replayed, is a no-op."""
    from stepmill.store import cache

    db = str(tmp_path / "once.db")
    journal = Journal.create(db)
    texts = [f"call {i}" for i in range(10)]
    _append_calls(journal, texts)
    put, raised = cache.LRU.put, []

    def put_that_raises_once(self, key, value):
        if not raised:
            raised.append(key)
            raise RecursionError("maximum recursion depth exceeded (after the commit)")
        return put(self, key, value)

    monkeypatch.setattr(cache.LRU, "put", put_that_raises_once)
    writer = _drain(db, journal)
    monkeypatch.setattr(cache.LRU, "put", put)
    assert raised, "the fault was not reached: the batch published nothing to the cache"
    assert writer.failing is None, writer.failing
    store = Store(db)
    assert sorted(_texts(store)) == sorted(texts), "a batch retried after its commit stored its calls again"
    # A replay from the start (a position lost or stale): every entry is read again and none is written.
    store.set_state(state_key(journal.id), str(Position(1, 0)))
    store.close()
    _drain(db, journal)
    store = Store(db)
    assert sorted(_texts(store)) == sorted(texts), "a journal replayed from its start stored its calls again"
    assert store.query("SELECT count(*) AS n FROM journal_entries")[0]["n"] == len(texts)
    store.close()
    journal.release()


def test_a_poison_entry_is_isolated_by_halving_and_kept_once_with_its_reason(tmp_path, monkeypatch):
    """An entry whose commit raises past every parser's guard (here a RecursionError injected into the
    writer's preparation of one call) fails its batch; the batch is halved until that entry is alone, and
    it is kept as one error step that names the error, with its raw bytes. The rest are committed once."""
    db = str(tmp_path / "poison.db")
    journal = Journal.create(db)
    texts = [f"call {i}" for i in range(7)] + ["poison call"] + [f"call {i}" for i in range(7, 12)]
    _append_calls(journal, texts)
    prepare = Ingest.prepare

    def prepare_that_overflows(self, record, blobs):
        if b"poison call" in blobs[0]:
            raise RecursionError("maximum recursion depth exceeded while preparing")
        return prepare(self, record, blobs)

    monkeypatch.setattr(Ingest, "prepare", prepare_that_overflows)
    writer = _drain(db, journal)
    assert writer.failing is None, f"the writer is stuck on the poison entry: {writer.failing}"
    store = Store(db)
    stored = _texts(store)
    assert sorted(stored) == sorted(t for t in texts if t != "poison call"), stored
    [poison] = store.query("SELECT status, error, raw_request FROM steps WHERE status = 'error'")
    assert "RecursionError" in poison["error"] and b"poison call" in bytes(poison["raw_request"]), poison
    assert store.query("SELECT count(*) AS n FROM steps")[0]["n"] == len(texts)
    store.close()
    journal.release()


def _writer_of(proxy_pid: int) -> int | None:
    """The pid of the writer process the proxy started (its child running stepmill.pipeline.writer)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"stepmill.pipeline.writer" in cmdline and ppid == proxy_pid:
            return int(pid)
    return None


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_writer_stuck_on_a_locked_file_goes_when_its_proxy_is_killed(tmp_path, upstream, marker):
    proxy = start_proxy(tmp_path, upstream, "--set", "stepmill_writer=process")
    writer_pid = wait_until(lambda: _writer_of(proxy.process.pid), what="the proxy's writer process")
    lock = sqlite3.connect(proxy.db, timeout=30, isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")  # the writer cannot commit: it waits, then says so and tries again
        http = httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]))
        client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http, max_retries=0)
        client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"stuck {marker}"}])
        wait_until(lambda: proxy.client().health()["capture"]["journaled"] >= 1, what="the call in the journal")
        size = os.path.getsize(proxy.db)
        proxy.process.send_signal(signal.SIGKILL)
        proxy.process.wait(10)
        killed = time.monotonic()
        gone = wait_until(lambda: not _alive(writer_pid), timeout=ORPHAN_GRACE + 10, interval=0.2,
                          what="the orphaned writer process to exit")
        assert gone and time.monotonic() - killed <= ORPHAN_GRACE + 10
        assert os.path.getsize(proxy.db) == size, "the file grew after the proxy was killed"
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        if _alive(writer_pid):
            os.kill(writer_pid, signal.SIGKILL)
    # The call is in the journal: the next proxy's writer commits it, once.
    follow = start_proxy(tmp_path, upstream)
    try:
        [step] = follow.steps("s.messages_suffix LIKE ?", [f"%stuck {marker}%"], timeout=30)
        assert step["status"] == "ok"
    finally:
        stop_proxy(follow)


def test_a_retire_cut_short_leaves_nothing_to_commit_again(tmp_path):
    """A journal is retired files first: a writer that dies before it clears the journal's position and
    identities leaves nothing the next writer could commit again, and that writer clears what is left."""
    db = str(tmp_path / "retire.db")
    journal = Journal.create(db)
    _append_calls(journal, ["a", "b", "c"])
    _drain(db, journal)
    journal.remove()  # the retire's first half: its files are gone, its position and identities are not
    store = Store(db)
    assert store.get_state(state_key(journal.id)) is not None
    store.close()
    writer = Writer(db, Journal.create(db).folder)
    opened = writer._start()  # the next writer of the file
    store, _ = opened
    assert sorted(_texts(store)) == ["a", "b", "c"]
    assert store.get_state(state_key(journal.id)) is None
    assert store.query("SELECT count(*) AS n FROM journal_entries")[0]["n"] == 0
    store.close()


def test_a_writer_that_cannot_store_an_entry_even_as_an_error_step_says_so_and_writes_nothing(tmp_path, monkeypatch):
    """The issue's orphaned writer committed the same entries for 51 minutes, growing the WAL by 80 MB a minute.
    A writer that cannot get past an entry now commits nothing, says why, waits longer each time (never past
    STUCK_WAIT, however long it stays stuck), and the file and its WAL do not grow."""
    from stepmill.pipeline import writer as writer_module

    db = str(tmp_path / "stuck.db")
    journal = Journal.create(db)
    _append_calls(journal, ["before"])
    _drain(db, journal)
    _append_calls(journal, ["poison call", "after"])

    def broken(self, record, blobs):
        raise MemoryError("no memory for this call, ever")

    monkeypatch.setattr(Ingest, "prepare", broken)
    monkeypatch.setattr(Ingest, "poison_entry", broken)  # not even an error step can be made of it
    sizes = []
    for _ in range(5):
        writer = _drain(db, journal)
        assert writer.failing and writer.failing.startswith("the writer cannot make progress: MemoryError"), writer.failing
        wal = db + "-wal"
        sizes.append((os.path.getsize(db), os.path.getsize(wal) if os.path.exists(wal) else 0))
    assert len(set(sizes)) == 1, f"the file or its WAL grew while the writer was stuck: {sizes}"
    store = Store(db)
    assert _texts(store) == ["before"]
    store.close()
    writer._stuck_waits = 5000  # stuck for days: the wait stays bounded
    assert writer._timeout(False) == writer_module.STUCK_WAIT
    journal.release()


def test_a_journal_left_after_a_writer_started_is_replayed_while_it_is_idle(tmp_path, monkeypatch):
    """A proxy started again within its old writer's grace: the old writer still holds its journal when the
    new one starts, so the new one finds it when idle (every ORPHAN_SCAN), not at some later start."""
    import subprocess
    import sys

    from stepmill.pipeline import writer as writer_module
    from stepmill.pipeline.writer import ThreadWriter

    monkeypatch.setattr(writer_module, "ORPHAN_SCAN", 0.5)
    db = str(tmp_path / "late.db")
    old = Journal.create(db)
    _append_calls(old, ["left by the old proxy"])
    old.release()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a');"
                               " fcntl.flock(f, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)",
                               str(old.folder / "lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the old writer, in its grace
        new = Journal.create(db)
        thread = ThreadWriter(db, new)
        time.sleep(1.5)
        store = Store(db)
        assert _texts(store) == [], "a journal still held by its writer was replayed"
        holder.kill()  # the old writer's grace ends
        holder.wait(10)
        wait_until(lambda: _texts(store) == ["left by the old proxy"], timeout=15,
                   what="the journal left behind, replayed while the new writer is idle")
        wait_until(lambda: not old.folder.exists(), what="the replayed journal retired")
        store.close()
        thread.close()
        new.release()
    finally:
        holder.kill()
        holder.wait(10)
