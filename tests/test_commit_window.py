"""The writer's commit window: calls of one window share a transaction; a barrier's flush commits at
once; and no call is left in the journal when wake-ups come while the writer gathers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import stepmill.pipeline.handoff as handoff_module
import stepmill.pipeline.writer as writer_module
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.handoff import Handoff
from stepmill.pipeline.journal import Journal, Position, decode_entry
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
    monkeypatch.setattr(handoff_module, "GATHER", 60.0)  # nor the handoff's gathering
    db = str(tmp_path / "f.db")
    pipeline = Pipeline(db, writer="thread")
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pipeline.submit(*_call("flushed"))
        wait_until(lambda: pipeline.handed_off() == 1, what="the first call, alone, journaled at once")
        pipeline.submit(*_call("gathered"))  # the handoff would gather this one for a minute
        started = time.monotonic()
        assert asyncio.run(pipeline.flushed(started + 20, executor))  # False had it waited out the deadline
        assert _committed(db) == ["flushed", "gathered"]
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


class CountingJournal(Journal):
    """A real journal that counts its appends (one per handoff pass)."""

    appends = 0

    def append(self, entry):
        self.appends += 1
        return super().append(entry)


def test_calls_that_end_close_together_are_journaled_in_one_pass(tmp_path, monkeypatch):
    """A call that ends alone is journaled at once; calls ending within GATHER of the last pass wait for
    one pass together (its cost is per pass more than per call); a flush's hurry ends the wait."""
    monkeypatch.setattr(handoff_module, "GATHER", 5.0)
    db = str(tmp_path / "h.db")
    Store(db).close()
    journal = CountingJournal.create(db)
    handoff = Handoff(journal, lambda: None)
    try:
        started = time.monotonic()
        handoff.submit(*_call("alone"))
        wait_until(lambda: handoff.appended == 1, timeout=4, what="a lone call, journaled at once")
        assert time.monotonic() - started < 4 and journal.appends == 1
        for text in ("a", "b", "c"):
            handoff.submit(*_call(text))
        time.sleep(0.5)
        assert handoff.appended == 1 and handoff.status()["in_memory"] == 3  # gathered, not yet journaled
        wait_until(lambda: handoff.appended == 4, timeout=10, what="the gathered calls")
        assert journal.appends == 2  # the three in one append
        handoff.submit(*_call("flushed"))
        hurried = time.monotonic()
        handoff.hurry()
        wait_until(lambda: handoff.appended == 5, timeout=4, what="a hurried call")
        assert time.monotonic() - hurried < 4
        handoff.submit(*_call("d"))  # the hurry was spent on the flushed call: this one is gathered again
        time.sleep(0.5)
        assert handoff.appended == 5 and handoff.status()["in_memory"] == 1
        handoff.hurry()
        wait_until(lambda: handoff.appended == 6, timeout=4, what="the last call")
        texts = sorted(json.loads(decode_entry(payload)[1][0])["messages"][0]["content"]
                       for _, payload in journal.read(Position(1, 0)))
        assert texts == ["a", "alone", "b", "c", "d", "flushed"]
    finally:
        handoff.close()
        journal.release()


def test_call_durability_journals_each_call_without_gathering(tmp_path, monkeypatch):
    """durability = "call": a call that ends right after a pass is journaled at once, not gathered with
    the calls after it (however long the gather would be)."""
    monkeypatch.setattr(handoff_module, "GATHER", 5.0)
    db = str(tmp_path / "c.db")
    Store(db).close()
    journal = CountingJournal.create(db)
    handoff = Handoff(journal, lambda: None, durability="call")
    try:
        for count, text in enumerate(("a", "b", "c"), start=1):
            started = time.monotonic()
            handoff.submit(*_call(text))
            wait_until(lambda: handoff.appended == count, timeout=4, interval=0.01, what=f"call {text} journaled")
            assert time.monotonic() - started < 1.0, "a call waited for a gather under durability = call"
        assert journal.appends == 3
    finally:
        handoff.close()
        journal.release()
