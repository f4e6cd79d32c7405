"""The journal and the writer, without a proxy: replay after a crash, torn tails, a full disk, and
WebSocket turns of any shape (property-based)."""

import json
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.handoff import Handoff
from stepmill.pipeline.ingest import Ingest
from stepmill.pipeline.writer import Writer
from stepmill.store import Store
from stepmill.pipeline.journal import Journal, Position, state_key

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
REPLY = {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                        "finish_reason": "stop"}]}


def record_parts(text: str) -> list:
    record = CallRecord(kind="http", call=Call(api="openai.chat", host="h", path="/v1/chat/completions"),
                        started=time.time(), ended=time.time(), http_status=200)
    request = {**CHAT, "messages": [{"role": "user", "content": text}]}
    return record.entry_parts([json.dumps(request).encode(), json.dumps(REPLY).encode()])


def entry(text: str) -> bytes:
    return b"".join(record_parts(text))


def test_entries_round_trip_and_torn_tails_are_ignored(tmp_path):
    journal = Journal.create(tmp_path / "j.db")
    first = journal.append(entry("one"))
    journal.append(entry("two")[:-7])  # a process killed mid-write leaves part of an entry
    read = list(journal.read(Position(1, 0)))
    assert [p for p, _ in read] == [first]
    record, blobs = CallRecord.from_entry(read[0][1])
    assert record.call.api == "openai.chat" and json.loads(blobs[0])["messages"][0]["content"] == "one"


def test_the_end_the_journal_counts_is_the_files_across_segments_and_refused_writes(tmp_path, monkeypatch):
    """Append keeps the open segment's end itself (no lseek per append): every position it returns is
    where the file ends, also after a new segment starts and after a batch the disk refused halfway
    (its first writev of 512 buffers taken, the second refused)."""
    import os

    import stepmill.pipeline.journal as journal_module

    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 1000)
    journal = Journal.create(tmp_path / "e.db")
    real_writev, refuse = os.writev, []

    def writev(fd, buffers):
        if refuse and refuse.pop():
            real_writev(fd, [bytes(buffers[0])[:5]])  # part of it reached the file
            raise OSError(28, "No space left on device")
        return real_writev(fd, buffers)

    monkeypatch.setattr(journal_module.os, "writev", writev)
    written = []
    for i in range(12):
        if i == 4:  # a batch of 100 calls: its buffers take two writev calls, the second refused
            batch = [part for k in range(100) for part in record_parts(f"lost {k}")]
            assert len(batch) > 512
            refuse[:] = [True, False]  # popped from the end: the first call goes through
            monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 10**6)  # the segment goes on after it
            try:
                journal.append(batch)
            except OSError:
                pass
            else:
                raise AssertionError("the refused batch was taken")
            assert not refuse
            continue
        position = journal.append(entry(f"call {i}"))
        assert position.offset == (journal.folder / f"{position.segment:08d}.seg").stat().st_size
        written.append(position)
    assert len({position.segment for position in written[:4]}) > 1
    assert len({position.segment for position in written[4:]}) == 1
    texts = [json.loads(CallRecord.from_entry(payload)[1][0])["messages"][0]["content"]
             for _, payload in journal.read(Position(1, 0))]
    assert texts == [f"call {i}" for i in range(12) if i != 4]

def test_the_next_writer_replays_an_orphaned_journal(tmp_path):
    db = tmp_path / "r.db"
    Store(db).close()
    dead = Journal.create(db)
    for i in range(5):
        dead.append(entry(f"orphan {i}"))
    dead.release()  # its proxy and writer died before committing
    live = Journal.create(db)
    writer = Writer(str(db), live.folder)
    thread = threading.Thread(target=writer.run)
    thread.start()
    writer.stop()
    thread.join(30)
    store = Store(db)
    texts = {m["content"] for s in store.iter_steps() for m in s["messages"]}
    assert texts == {f"orphan {i}" for i in range(5)}
    assert not dead.folder.exists() and store.get_state(state_key(dead.id)) is None


def test_a_full_disk_keeps_calls_in_memory_until_the_journal_takes_them(tmp_path):
    class Refusing(Journal):
        refuse = True

        def append(self, data):
            if self.refuse:
                raise OSError(28, "No space left on device")
            return super().append(data)

    journal = Refusing(tmp_path / "x")
    journal.folder.mkdir()
    woken = []
    handoff = Handoff(journal, lambda: woken.append(1), memory_limit=10_000)
    record = CallRecord(kind="http", call=Call(api="openai.chat", host="h", path="/p"), started=0)
    handoff.submit(record, [b"x" * 4000])
    handoff.submit(record, [b"y" * 4000])
    handoff.submit(record, [b"z" * 4000])  # past the memory bound: counted, not kept
    time.sleep(0.3)
    status = handoff.status()
    assert status["in_memory"] == 2 and status["dropped"] == 1 and "No space" in status["journal_error"]
    journal.refuse = False
    handoff._wake.set()
    time.sleep(0.8)
    assert handoff.status()["in_memory"] == 0 and handoff.status()["journaled"] == 2 and woken
    handoff.close()


def test_a_call_that_cannot_be_cleaned_is_kept_as_an_error_and_the_handoff_goes_on(tmp_path, caplog):
    """Whatever goes wrong cleaning one call (a bug, a body nothing decodes), the call is kept without
    its bodies, the writer stores it as an error step, and the calls after it are recorded as usual."""
    class Fragile(Handoff):
        @staticmethod
        def clean(record, blobs):
            if b"poison" in blobs[0]:
                raise ValueError("a body nothing decodes")
            return Handoff.clean(record, blobs)

    db = tmp_path / "c.db"
    Store(db).close()
    journal = Journal.create(db)
    handoff = Fragile(journal, lambda: None)
    for text in ("poison", "after"):
        record = CallRecord(kind="http", call=Call(api="openai.chat", host="h", path="/v1/chat/completions"),
                            started=time.time(), ended=time.time(), http_status=200)
        handoff.submit(record, [json.dumps({**CHAT, "messages": [{"role": "user", "content": text}]}).encode(),
                                json.dumps(REPLY).encode()])
    deadline = time.time() + 10
    while handoff.status()["journaled"] < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert handoff.status()["journaled"] == 2 and handoff.thread.is_alive()
    handoff.close()
    writer = Writer(str(db), journal.folder)
    thread = threading.Thread(target=writer.run)
    thread.start()
    writer.stop()
    thread.join(30)
    steps = list(Store(db).iter_steps())
    assert len(steps) == 2, steps
    kept = [s for s in steps if "could not clean this call" in json.dumps(s)]
    assert len(kept) == 1 and "poison" not in json.dumps(kept[0]), kept
    assert any(m["content"] == "after" for s in steps for m in s["messages"])
    assert "could not clean a call" in caplog.text


FRAME = st.one_of(
    st.builds(lambda t, d: json.dumps({"type": t, "delta": d, "output_index": 0}),
              st.sampled_from(["response.output_text.delta", "response.created", "response.completed", "error",
                               "response.output_item.added", "mystery", "response.failed"]),
              st.one_of(st.text(max_size=10), st.integers(), st.none())),
    st.text(max_size=30),
    st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=st.one_of(st.just(json.dumps({"type": "response.create", "model": "m", "input": "hi"})),
                         st.text(max_size=40)),
       frames=st.lists(FRAME, max_size=8), cut=st.one_of(st.none(), st.text(max_size=20)))
def test_websocket_turns_of_any_shape_become_steps(tmp_path_factory, request, frames, cut):
    store = Store(tmp_path_factory.mktemp("ws") / "ws.db")
    record = CallRecord(kind="websocket", call=Call(api="openai.responses", host="h", path="/v1/responses"),
                        started=1.0, ended=2.0, cut=cut, frames=[(1.5, i + 1) for i in range(len(frames))])
    blobs = [request.encode("utf-8", "surrogatepass")] + [f.encode("utf-8", "surrogatepass") for f in frames]
    result = Ingest(store).handle(record, blobs)
    assert result in ("full", "parsed", "bare", "warmup")
    if result != "warmup":
        assert store.query("SELECT count(*) AS n FROM steps")[0]["n"] == 1
    store.close()
