"""The writer's commit window: calls of one window share a transaction; a barrier's flush commits at
once; and no call is left in the journal when wake-ups come while the writer gathers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import stepmill.pipeline.writer as writer_module
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.handoff import Handoff
from stepmill.pipeline.journal import Journal
from stepmill.pipeline.service import Pipeline
from stepmill.pipeline.writer import Writer
from stepmill.store import Store

from .conftest import wait_until

REPLY = {"id": "c1", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                "finish_reason": "stop"}]}


def _call(text: str) -> tuple[CallRecord, list[bytes]]:
    request = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return (CallRecord(kind="http", call=Call("openai.chat", "h", "/v1/chat/completions"), started=time.time(),
                       ended=time.time(), http_status=200),
            [json.dumps(request).encode(), json.dumps(REPLY).encode()])


def _committed(db: str) -> list[str]:
    store = Store(db, readonly=True)
    try:
        return sorted(m["content"] for s in store.iter_steps() for m in s["messages"])
    finally:
        store.close()


def test_a_flush_commits_without_waiting_out_the_window(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "COMMIT_WINDOW", 60.0)  # a window no barrier could wait out
    db = str(tmp_path / "f.db")
    pipeline = Pipeline(db, writer="thread")
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pipeline.submit(*_call("flushed"))
        started = time.monotonic()
        assert asyncio.run(pipeline.flushed(started + 20, executor))
        assert _committed(db) == ["flushed"]
    finally:
        pipeline.close()
        executor.shutdown()


def test_calls_announced_while_the_writer_gathers_are_committed_without_another_call(tmp_path, monkeypatch):
    """The handoff wakes the writer once a window. A wake-up the writer takes while it gathers (it woke
    late, at idle priority) is kept for the next window, so a call appended after that window's read,
    and left unannounced, is still committed."""
    window = 0.4
    monkeypatch.setattr(writer_module, "COMMIT_WINDOW", window)
    db = str(tmp_path / "g.db")
    Store(db).close()
    journal = Journal.create(db)
    handoff = Handoff(journal, lambda: None)  # the wake-ups are this test's
    writer = Writer(db, journal.folder)
    thread = threading.Thread(target=writer.run, daemon=True)
    thread.start()

    def append(text: str) -> None:
        handoff.submit(*_call(text))
        wait_until(lambda: handoff.appended == ["first", "second", "third"].index(text) + 1, what="appended")

    try:
        append("first")
        writer.wake()  # the writer gathers for a window
        time.sleep(window / 2)
        append("second")
        writer.wake()  # taken while it gathers
        wait_until(lambda: _committed(db) == ["first", "second"], timeout=10, what="the first window")
        append("third")  # after that window's read: the handoff would not wake the writer so soon again
        wait_until(lambda: _committed(db) == ["first", "second", "third"], timeout=3 * window + 2,
                   what="the call announced by no wake-up")
    finally:
        handoff.close()
        writer.stop()
        thread.join(10)
        journal.release()
