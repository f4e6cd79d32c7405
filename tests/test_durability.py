"""Nothing finished is lost: kill -9 of the proxy, a database locked by another process, and many
processes on one file at once. These are the README's durability promises, measured."""

import concurrent.futures
import json
import signal
import sqlite3
import ssl
import subprocess
import threading
import time

import httpx2
import openai
import pytest

from .browser import UI
from .conftest import STEPMILL, start_proxy, stop_proxy, wait_until

# A call is in the journal this long after its last byte reached the agent (README: durability).
JOURNAL_BOUND = 0.5


def _client(proxy) -> openai.OpenAI:
    http = httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                         timeout=30)
    return openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http, max_retries=0)


def _stream(client, text: str) -> float:
    """One streamed call; the time its last event reached the agent."""
    for _ in client.chat.completions.create(model="gpt-test", stream=True,
                                            messages=[{"role": "user", "content": text}]):
        pass
    return time.time()


def _integrity(db) -> None:
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_kill_9_during_32_streams_loses_nothing_finished(tmp_path, upstream, marker, writer):
    proxy = start_proxy(tmp_path / "a", upstream, "--set", f"stepmill_writer={writer}")
    client = _client(proxy)
    finished: dict[str, float] = {}
    killed_at = []

    def run(i):
        text = f"kill {marker} {i}"
        time.sleep(i * 0.08)  # staggered: streams end all through the run, and some are in flight at the kill
        try:
            finished[text] = _stream(client, text)
        except Exception:
            pass  # cut by the kill

    def settled() -> int:
        """Streams whose last byte reached the agent longer than the journal's bound ago."""
        now = time.time()
        return sum(1 for at in list(finished.values()) if at < now - JOURNAL_BOUND)

    def kill_mid_way():
        # The premise (at least 10 streams past the bound when the kill comes) is waited for, not hoped
        # for: on a loaded machine streams end in bunches, and 18 just finished may all be within it.
        wait_until(lambda: len(finished) >= 18 and settled() >= 10, timeout=90, what="10 streams past the bound")
        killed_at.append(time.time())
        proxy.process.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_way)
    killer.start()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(run, range(32)))
    killer.join()
    proxy.process.wait(10)
    # Another proxy on the same file: it replays what a dead writer journaled but had not committed
    # (in process mode the old writer, told by the closed pipe, commits it even before).
    follow = start_proxy(tmp_path / "a", upstream, "--set", f"stepmill_writer={writer}")
    try:
        store = proxy.store()
        must = [text for text, at in finished.items() if at < killed_at[0] - JOURNAL_BOUND]
        assert len(must) >= 10

        def present():
            rows = store.query("SELECT messages_suffix, status FROM steps")
            texts = {m["content"] for r in rows for m in json.loads(r["messages_suffix"] or "[]")}
            return all(t in texts for t in must)

        wait_until(present, timeout=30, what="every stream finished before the kill")
        rows = store.query("SELECT status, completion FROM steps")
        assert all(r["status"] in ("ok", "incomplete", "error") for r in rows)
        assert all(r["completion"] for r in rows if r["status"] == "ok")  # none half-written
    finally:
        stop_proxy(follow)
    _integrity(proxy.db)
    assert not list((proxy.db.parent / "steps.db.journal").glob("*/*.seg")), "the journal was replayed and removed"


def test_a_database_locked_for_10_seconds_stalls_no_stream(tmp_path, upstream, marker):
    """Another process holds the write lock for 10 s (or until 32 streams ended) while 16 clients keep streaming."""
    proxy = start_proxy(tmp_path, upstream)
    try:
        client = _client(proxy)
        _stream(client, f"warm {marker}")
        holder = sqlite3.connect(proxy.db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        locked_until = time.time() + 10
        durations, count = [], [0]

        def run(i):
            # 32 streams at least, however loaded the machine: the lock is held until they are done.
            while time.time() < locked_until - 1 or count[0] < 32:
                started = time.time()
                _stream(client, f"locked {marker} {i}.{count[0]}")
                count[0] += 1
                durations.append(time.time() - started)

        try:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(run, range(16)))
            # A stream that waited for the lock would take most of its 10 s; a loaded 2-core machine
            # takes up to ~2.5 s for one unlocked: the bound is between the two, not a speed target.
            assert max(durations) < 5.0, f"a stream waited for the database: {max(durations):.1f} s"
            status = proxy.client().health()["capture"]
            assert status["uncommitted_bytes"] > 0 and status["dropped"] == 0  # waiting in the journal, visible
            time.sleep(max(0.0, locked_until - time.time()))
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        steps = proxy.steps("s.messages_suffix LIKE ?", [f"%locked {marker}%"], count=count[0], timeout=60)
        assert len(steps) == count[0] >= 32 and {s["status"] for s in steps} == {"ok"}
        wait_until(lambda: proxy.client().health()["capture"]["uncommitted_bytes"] == 0, what="backlog drained")
    finally:
        stop_proxy(proxy)


@pytest.mark.slow  # about 50 s: two proxies, the UI and the CLI's processes
def test_many_processes_on_one_file(tmp_path, upstream, marker):
    """Two proxies, Datasette, `tokenize` (a writer), exports and stats on one file while traffic flows."""
    from stepmill.qwen_vocab import QWEN_TEMPLATE as KEEP_THINKING
    from stepmill.qwen_vocab import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer(tmp_path / "qwen", KEEP_THINKING)
    first = start_proxy(tmp_path / "one", upstream)
    second = start_proxy(tmp_path / "one", upstream)  # the same file, its own journal and writer
    ui = UI(first.db).__enter__()  # signed in through the link it prints
    outputs = []
    try:
        one = _client(first)
        two = openai.OpenAI(api_key="sk-x", base_url=f"http://127.0.0.1:{second.reverse_port}/v1", max_retries=0)
        stop = threading.Event()

        def readers():
            while not stop.is_set():
                for command in (["export", "--db", str(first.db), "--no-tokens"], ["stats", "--db", str(first.db)],
                                ["tokenize", "--db", str(first.db), "--tokenizer", str(tokenizer)]):
                    done = subprocess.run(STEPMILL + command, capture_output=True, text=True, timeout=60)
                    outputs.append(done.stderr + done.stdout)
                    assert done.returncode == 0, done.stderr
                assert ui.get("/steps/steps.json?_size=5")[0] == 200

        reader = threading.Thread(target=readers)
        reader.start()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: (one if i % 2 else two).chat.completions.create(
                model="gpt-test", messages=[{"role": "user", "content": f"many {marker} {i}"}]), range(40)))
        stop.set()
        reader.join()
        steps = first.steps("s.messages_suffix LIKE ?", [f"%many {marker}%"], count=40, timeout=30)
        assert len(steps) == 40
        assert not any("database is locked" in out for out in outputs)
        assert any("rendered" in out and "rendered 0 steps" not in out for out in outputs)  # tokenize wrote
    finally:
        ui.__exit__(None, None, None)
        stop_proxy(second)
        stop_proxy(first)
    _integrity(first.db)
