"""The full-text index is filled after the steps' commit (store/search.py): by the writer within
SEARCH_WAIT, by the UI before a search, and it stays exact through edits and deletes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sqlite3
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.service import Pipeline
from stepmill.pipeline.writer import SEARCH_WAIT
from stepmill.store import StepRecord, Store
from stepmill.store.migrations import MIGRATIONS, SEARCH_MARK
from stepmill.store.sqlite_library import sqlite_utils

WORDS = ["zebra", "lion", "giraffe", "otter", "heron", "lynx"]


def _found(store: Store, word: str) -> set[str]:
    return {row[0] for row in store.db.conn.execute(
        "SELECT s.id FROM steps_fts JOIN steps s ON s.rowid = steps_fts.rowid WHERE steps_fts MATCH ?", [word])}


def _holding(store: Store, word: str) -> set[str]:
    """What a search should find: every step whose indexed text holds the word (as a token)."""
    return {step_id for step_id, text in store.db.conn.execute(
        "SELECT id, coalesce(messages_suffix, '') || ' ' || coalesce(completion, '') FROM steps")
        if word in text.replace('"', " ").replace(",", " ").split()}


def _exact(store: Store) -> None:
    store.db.conn.execute("INSERT INTO steps_fts (steps_fts) VALUES ('integrity-check')")  # raises if not
    for word in WORDS:
        assert _found(store, word) == _holding(store, word), word


def _step(store: Store, word: str) -> str:
    return store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": f"about {word}"}],
                                        completion={"role": "assistant", "content": "noted"}))


def test_a_step_is_found_once_indexed_and_indexing_twice_adds_nothing(tmp_path):
    store = Store(str(tmp_path / "s.db"))
    step = _step(store, "zebra")
    assert _found(store, "zebra") == set() and store.search_behind() == 1  # committed without the index
    assert store.index_search() == 1 and _found(store, "zebra") == {step}
    assert store.index_search() == 0 and store.search_behind() == 0
    _exact(store)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "index", "edit", "reward", "drop_newest", "drop_any"]),
                          st.sampled_from(WORDS)), max_size=30))
def test_the_index_stays_exact_through_edits_and_deletes(tmp_path_factory, operations):
    store = Store(str(tmp_path_factory.mktemp("ops") / "s.db"))
    conn = store.db.conn
    for operation, word in operations:
        newest = conn.execute("SELECT max(rowid) FROM steps").fetchone()[0]
        if operation == "add":
            _step(store, word)
        elif operation == "index":
            store.index_search()
        elif newest is None:
            continue
        elif operation == "edit":  # the indexed text changes: an indexed row is indexed again
            conn.execute("UPDATE steps SET completion = ? WHERE rowid = ?",
                         [json.dumps({"role": "assistant", "content": f"now {word}"}), newest // 2 + 1])
        elif operation == "reward":  # no edit of the text: the index is not touched
            conn.execute("UPDATE steps SET reward = 1.0 WHERE rowid = ?", [newest])
        elif operation == "drop_newest":  # its rowid is given again to the next step
            conn.execute("DELETE FROM steps WHERE rowid = ?", [newest])
        else:
            conn.execute("DELETE FROM steps WHERE rowid = ?", [newest // 2 + 1])
    store.index_search()
    assert store.search_behind() == 0
    _exact(store)
    store.close()


def test_a_file_indexed_by_the_old_triggers_keeps_every_step_searchable(tmp_path):
    path = str(tmp_path / "old.db")
    db = sqlite_utils.Database(sqlite3.connect(path, isolation_level=None))
    db["schema_migrations"].create({"version": int, "name": str, "applied_at": str}, pk="version")
    for version, (name, apply) in enumerate(MIGRATIONS[:15], start=1):  # the file as the release before made it
        apply(db)
        db["schema_migrations"].insert({"version": version, "name": name, "applied_at": "2026-01-01"})
    db["trajectories"].insert({"id": "t1"})
    db["steps"].insert({"id": "old", "trajectory_id": "t1", "messages_suffix": '[{"content": "about lion"}]'})
    db.conn.close()
    store = Store(path)  # migrated: the insert trigger goes, what it indexed stays found
    assert store.get_state(SEARCH_MARK) == "1" and _found(store, "lion") == {"old"}
    new = _step(store, "lion")
    assert _found(store, "lion") == {"old"} and store.index_search() == 1 and _found(store, "lion") == {"old", new}
    _exact(store)


def test_the_writer_indexes_what_it_committed_within_the_search_wait(tmp_path):
    db = str(tmp_path / "w.db")
    pipeline = Pipeline(db, writer="thread")
    executor = concurrent.futures.ThreadPoolExecutor(1)
    reply = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "a heron"}, "finish_reason": "stop"}]}
    try:
        request = {"model": "m", "messages": [{"role": "user", "content": "which bird"}]}
        pipeline.submit(CallRecord(kind="http", call=Call("openai.chat", "h", "/v1/chat/completions"),
                                   started=time.time(), ended=time.time(), http_status=200),
                        [json.dumps(request).encode(), json.dumps(reply).encode()])
        assert asyncio.run(pipeline.flushed(time.monotonic() + 30, executor))
        committed = time.monotonic()
        store = Store(db, readonly=True)
        while not _found(store, "heron"):
            assert time.monotonic() - committed < SEARCH_WAIT + 2.0, "not indexed within the search wait"
            time.sleep(0.05)
        assert store.search_behind() == 0
        store.close()
    finally:
        pipeline.close()
        executor.shutdown()
