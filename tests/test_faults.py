"""Faults injected into the pipeline's background loops: each bad call (or read) is reported — as an
error step, a count, and in ``/v1/health`` — and every other call is committed; no thread dies.

Through a real ``stepmill proxy`` (its writer a thread, faults patched in by ``fault_injection.py``):
a cleaning step that raises, a parser that raises, state reads that fail. With the real pipeline on a
real journal and SQLite file: a journal entry that is no call record."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import ssl
import subprocess
import time

import httpx2
import openai
import pytest

from stepmill.auth.secret_hashes import secret_hash
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.journal import UNREADABLE_KEY, Journal, entry_parts
from stepmill.pipeline.service import Pipeline
from stepmill.pipeline.writer import ProcessWriter
from stepmill.store import Store

from .conftest import STEPMILL, TESTS, start_proxy, stop_proxy, wait_until


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, upstream):
    proxy = start_proxy(tmp_path_factory.mktemp("faults"), upstream, "-s", str(TESTS / "fault_injection.py"),
                        "--set", "stepmill_writer=thread")
    yield proxy
    stop_proxy(proxy)


def _client(proxy, url: str | None = None) -> openai.OpenAI:
    http_client = httpx2.Client(proxy=url or proxy.url,
                                verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]))
    return openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http_client, max_retries=0)


def _ask(client: openai.OpenAI, text: str, stream: bool = False) -> None:
    reply = client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": text}],
                                           stream=stream)
    if stream:
        for _ in reply:
            pass


def _capture(proxy) -> dict:
    return proxy.client().health()["capture"]


def _watch_errors(proxy) -> list:
    """Why each worker's state watch is behind (None where it is not)."""
    capture = _capture(proxy)
    return [worker["threads"]["state_watch"]["error"] for worker in capture.get("workers") or [capture]]


def _not_cleaned(proxy) -> int:
    """Calls journaled without their bodies, by every worker of the proxy."""
    capture = _capture(proxy)
    return capture.get("not_cleaned_all_workers", capture["not_cleaned"])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_call_whose_cleaning_raises_is_an_error_step_and_the_calls_around_it_are_committed(faulty, marker, stream):
    def not_cleaned_steps() -> list[dict]:
        return [s for s in _all_steps(faulty) if "could not clean this call" in (s["error"] or "")]

    client = _client(faulty)
    before, already = _not_cleaned(faulty), len(not_cleaned_steps())
    for text in (f"first {marker}", f"fault:clean {marker}", f"last {marker}"):
        _ask(client, text, stream=stream)
    steps = _steps_of(faulty, marker, 2, lambda s: s["status"] == "ok")
    assert sorted(m["content"] for s in steps for m in s["messages"] if m["role"] == "user") == \
        [f"first {marker}", f"last {marker}"]
    bad = wait_until(lambda: (found := not_cleaned_steps()) and len(found) > already and found[-1],
                     what="the call that could not be cleaned")  # its worker's writer may commit it later
    assert bad["status"] == "error" and not bad["raw_request"] and marker not in json.dumps(bad, default=str)
    # the step says why it has no bodies, not that its empty bodies are no JSON
    assert bad["error"].startswith("stepmill could not clean this call") and "JSON" not in bad["error"], bad["error"]
    capture = _capture(faulty)
    assert _not_cleaned(faulty) == before + 1 and capture["alive"], capture


def test_a_parser_that_raises_makes_an_error_step_and_the_writer_goes_on(faulty, marker):
    client = _client(faulty)
    for text in (f"fault:parse {marker}", f"after {marker}"):
        _ask(client, text)
    steps = _steps_of(faulty, marker, 2)
    [bad] = [s for s in steps if s["status"] == "error"]
    assert "an injected parser fault" in bad["error"] and b"fault:parse" in bad["raw_request"]
    [good] = [s for s in steps if s["status"] == "ok"]
    assert good["messages"][0]["content"] == f"after {marker}"
    capture = _capture(faulty)
    assert capture["alive"] and capture["threads"]["writer"] == {"alive": True, "error": None}, capture


def test_failed_state_reads_are_reported_and_read_again(faulty, marker):
    """While the file cannot be read, calls are still committed and health says why the watch is behind;
    the registration it missed is read once the file answers (a failed read is never marked seen)."""
    flag = faulty.db.parent / "fault-state-reads"
    flag.touch()
    try:
        store = faulty.store()
        store.start_trajectory(trajectory_id=f"run-{marker}", group_id=f"grp-{marker}")
        store.register_run(f"run-{marker}", secret_hash("s3cret"))
        store.close()
        wait_until(lambda: all(_watch_errors(faulty)), what="every worker's watch to report its failure")
        _ask(_client(faulty), f"meanwhile {marker}")
        _steps_of(faulty, f"meanwhile {marker}", 1, lambda s: s["status"] == "ok")
        assert _capture(faulty)["threads"]["state_watch"]["alive"]
    finally:
        flag.unlink()
    wait_until(lambda: not any(_watch_errors(faulty)), what="every worker's watch to read again")
    host = f"127.0.0.1:{faulty.port}"
    with pytest.raises(openai.PermissionDeniedError):  # the run it read late: its secret is asked for
        _ask(_client(faulty, f"http://run-{marker}:wrong@{host}"), f"intruder {marker}")


def _all_steps(proxy) -> list[dict]:
    """Every step as exported, with its raw request (kept for error steps)."""
    store = proxy.store()
    try:
        raw = {row["id"]: row["raw_request"] for row in store.query("SELECT id, raw_request FROM steps")}
        return [{**step, "raw_request": raw[step["step_id"]]} for step in store.iter_steps()]
    finally:
        store.close()


def _steps_of(proxy, marker: str, count: int, which=lambda step: True) -> list[dict]:
    """The steps whose conversation or raw request holds ``marker``, once ``count`` of them are ``which``."""
    def found():
        steps = [s for s in _all_steps(proxy)
                 if marker in json.dumps(s["messages"]) or marker.encode() in (s["raw_request"] or b"")]
        return steps if sum(1 for s in steps if which(s)) >= count else None
    return wait_until(found, what=f"{count} steps of {marker}")


REPLY = {"id": "c1", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                "finish_reason": "stop"}]}


def _submit(pipeline: Pipeline, text: str) -> None:
    """A finished chat call saying ``text``, handed to the pipeline as the loop would."""
    request = {"model": "m", "messages": [{"role": "user", "content": text}]}
    pipeline.submit(CallRecord(kind="http", call=Call("openai.chat", "h", "/v1/chat/completions"),
                               started=time.time(), ended=time.time(), http_status=200),
                    [json.dumps(request).encode(), json.dumps(REPLY).encode()])


def test_an_unreadable_journal_entry_is_an_error_step_counted_and_the_writer_goes_on(tmp_path):
    db = str(tmp_path / "u.db")
    pipeline = Pipeline(db, writer="thread")
    executor = concurrent.futures.ThreadPoolExecutor(1)

    def submit(text: str) -> None:
        _submit(pipeline, text)
        assert asyncio.run(pipeline.flushed(time.monotonic() + 30, executor))

    try:
        submit("before")
        # Between the handoff's appends (it is idle now): an entry whose CRC holds but which is no call record
        pipeline.journal.append(entry_parts({"version": 2, "call": "nonsense"}, [b"x"]))
        submit("after")
        status = pipeline.status()
        assert status["unreadable_calls"] == 1 and status["alive"], status
        assert status["threads"]["writer"] == {"alive": True, "error": None}
    finally:
        pipeline.close()
        executor.shutdown()
    store = Store(db)
    steps = list(store.iter_steps())
    assert sorted(m["content"] for s in steps for m in s["messages"]) == ["after", "before"]
    [bad] = [s for s in steps if s["status"] == "error"]
    assert "could not read this journal entry" in bad["error"] and store.get_state(UNREADABLE_KEY) == "1"
    store.close()
    text = subprocess.run(STEPMILL + ["stats", "--db", db], check=True, capture_output=True, text=True).stdout
    assert "unreadable calls: 1, kept as error steps" in text


def test_stats_asks_a_running_proxy_whether_its_threads_live(faulty):
    args = STEPMILL + ["stats", "--db", str(faulty.db), "--proxy", faulty.url, "--confdir", str(faulty.confdir)]
    text = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    assert "handoff alive, writer alive, state watch alive; dropped 0" in text, text
    data = json.loads(subprocess.run(args + ["--json"], check=True, capture_output=True, text=True).stdout)
    assert data["capture"]["alive"] is True and "unreadable_calls" in data
    unreachable = subprocess.run(STEPMILL + ["stats", "--db", str(faulty.db), "--proxy", "http://127.0.0.1:9"],
                                 check=True, capture_output=True, text=True).stdout
    assert "did not answer its health" in unreachable


def test_a_writer_process_that_cannot_open_the_database_says_why_and_starts_once_it_can(tmp_path):
    """Its start is guarded as its batches are: it lives, health is told why it is behind, and it goes on."""
    db = tmp_path / "later.db"
    db.mkdir()  # a folder where the file should be: SQLite cannot open it, for now
    journal = Journal.create(str(db))
    writer = ProcessWriter(str(db), journal, "normal")
    try:
        status = wait_until(lambda: (s := writer.status())["error"] and s, what="the writer's reason")
        assert status["alive"] and status["error"].startswith("the writer cannot start"), status
        db.rmdir()  # the file can be made now: the writer's next try opens it
        wait_until(lambda: writer.status() == {"alive": True, "error": None}, what="the writer started")
        assert db.is_file()
    finally:
        writer.close()
        journal.release()
    assert writer.process.returncode == 0


def test_a_writer_process_killed_is_started_again_and_commits_what_came_meanwhile(tmp_path, monkeypatch):
    """kill -9 of the writer process: health says it is not alive; the next call's wake-up (or a barrier)
    starts another, which commits from where the file says, and health counts the restart."""
    import signal

    import stepmill.pipeline.writer as writer_module
    from stepmill.cli.data import _capture_line

    monkeypatch.setattr(writer_module, "RESTART_WAIT", 0.0)  # the test kills it right after its start
    db = str(tmp_path / "k.db")
    pipeline = Pipeline(db, writer="process", priority="normal")
    executor = concurrent.futures.ThreadPoolExecutor(1)

    def submit(text: str) -> None:
        _submit(pipeline, text)

    try:
        submit("before")
        assert asyncio.run(pipeline.flushed(time.monotonic() + 30, executor))
        first = pipeline.writer.process
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        status = pipeline.status()
        assert not status["alive"] and status["threads"]["writer"]["alive"] is False, status
        submit("meanwhile")
        assert asyncio.run(pipeline.flushed(time.monotonic() + 30, executor))
        assert pipeline.writer.process is not first and pipeline.writer.process.poll() is None
        status = pipeline.status()
        assert status["alive"] and status["threads"]["writer"] == {"alive": True, "error": None, "restarts": 1}, status
        assert "writer alive (started again 1×)" in _capture_line(status)  # as `stepmill stats --proxy` says it
    finally:
        pipeline.close()
        executor.shutdown()
    store = Store(db)
    assert sorted(m["content"] for s in store.iter_steps() for m in s["messages"]) == ["before", "meanwhile"]
    store.close()
