"""The record the event loop hands to the pipeline: to the journal's bytes and back, and the entries a
journal of the previous release holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.pipeline.call_record import KINDS, VERSION, Call, CallRecord
from stepmill.pipeline.journal import encode_entry
from stepmill.tags import Tags

text = st.text(max_size=20)  # lone surrogates included: the journal carries whatever a header held
maybe_text = st.none() | text
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
calls = st.builds(
    Call, api=text, host=text, path=text,
    tags=st.builds(Tags, maybe_text, maybe_text, maybe_text),  # the secret never goes to the journal
    session_id=maybe_text, headers=st.none() | st.dictionaries(text, text, max_size=3),
    client_conn=maybe_text, default_channel=maybe_text)
records = st.builds(
    CallRecord, kind=st.sampled_from(KINDS), call=calls, started=times, ended=st.none() | times,
    render_with=maybe_text, policy_version=maybe_text, keep_raw=st.booleans(),
    max_body=st.none() | st.integers(0, 2**40), request_encoding=maybe_text, response_encoding=maybe_text,
    error=maybe_text, http_status=st.none() | st.integers(100, 599), websocket_upgrade=st.booleans(),
    response_started=st.none() | times, received=st.none() | st.integers(0, 2**40),
    marks=st.none() | st.lists(st.tuples(st.integers(0, 2**40), st.none() | times), max_size=4),
    notes=st.lists(text, max_size=3), cut=maybe_text,
    frames=st.lists(st.tuples(times, st.integers(1, 100)), max_size=4),
    request_problem=maybe_text, response_problem=maybe_text, truncated=st.lists(text, max_size=2))


@settings(max_examples=300, deadline=None)
@given(records, st.lists(st.binary(max_size=64), max_size=4))
def test_round_trip(record, blobs):
    payload = b"".join(record.entry_parts(blobs))[8:]  # past the entry's length and CRC
    back, back_blobs = CallRecord.from_entry(payload)
    assert back == record
    assert back.version == VERSION
    assert back_blobs == blobs


def test_reads_the_previous_release():
    """A flat header without a version, as the previous release wrote it, replays."""
    old = {"kind": "sse", "api": "openai.chat", "host": "h", "path": "/v1/chat/completions",
           "tags": ["t1", "g1", "eval"], "session_id": "s", "headers": {"user-agent": "x"}, "client_conn": "c",
           "default_channel": "train", "started": 1.5, "render_with": None, "policy_version": "p3",
           "keep_raw": True, "request_encoding": None, "error": "reset", "ended": 2.5, "http_status": 200,
           "websocket_upgrade": False, "max_body": 1024, "marks": [[10, 1.75], [20, 2.0]],
           "response_encoding": None, "notes": ["a note"], "received": 20, "truncated": ["cut"],
           "request_problem": "p"}
    record, blobs = CallRecord.from_entry(encode_entry(old, [b"req", b"resp"])[8:])
    assert blobs == [b"req", b"resp"]
    assert record.version == 1
    assert record.call == Call(api="openai.chat", host="h", path="/v1/chat/completions",
                               tags=Tags("t1", "g1", "eval"), session_id="s", headers={"user-agent": "x"},
                               client_conn="c", default_channel="train")
    assert (record.kind, record.started, record.ended, record.policy_version, record.keep_raw) == \
        ("sse", 1.5, 2.5, "p3", True)
    assert (record.error, record.http_status, record.max_body, record.received) == ("reset", 200, 1024, 20)
    assert record.marks == [(10, 1.75), (20, 2.0)]
    assert (record.notes, record.truncated, record.request_problem) == (["a note"], ["cut"], "p")

    turn = {"kind": "websocket", "api": "openai.responses", "host": "h", "path": "/v1/responses",
            "tags": [None, None, None], "started": 3.0, "ended": 4.0, "cut": None, "frames": [[3.5, 1], [3.9, 2]]}
    record = CallRecord.from_header(turn)
    assert record.frames == [(3.5, 1), (3.9, 2)] and record.call.tags == Tags()
    assert record.to_header()["version"] == VERSION


def test_a_journal_of_the_previous_release_replays(tmp_path):
    """Entries the previous release appended (flat headers, bodies still gzip-encoded) become steps when the
    next writer finds their journal."""
    import gzip
    import json
    import threading

    from stepmill.pipeline.journal import Journal
    from stepmill.pipeline.writer import Writer
    from stepmill.store import Store

    db = tmp_path / "old.db"
    Store(db).close()
    left = Journal.create(db)
    reply = {"id": "c1", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                    "finish_reason": "stop"}]}
    for i in range(3):
        header = {"kind": "http", "api": "openai.chat", "host": "h", "path": "/v1/chat/completions",
                  "tags": [f"t{i}", "g", None], "session_id": None, "headers": None, "client_conn": None,
                  "default_channel": "train", "started": 1.0, "render_with": None, "policy_version": "p1",
                  "keep_raw": False, "request_encoding": "gzip", "error": None, "ended": 2.0, "http_status": 200,
                  "websocket_upgrade": False, "max_body": 0, "response_started": 1.5, "response_encoding": None,
                  "notes": []}
        request = {"model": "m", "messages": [{"role": "user", "content": f"old {i}"}]}
        left.append(encode_entry(header, [gzip.compress(json.dumps(request).encode()), json.dumps(reply).encode()]))
    left.release()  # its proxy stopped before the writer committed them

    writer = Writer(str(db), Journal.create(db).folder)
    thread = threading.Thread(target=writer.run)
    thread.start()
    writer.stop()
    thread.join(30)
    store = Store(db)
    steps = list(store.iter_steps())
    assert sorted(m["content"] for s in steps for m in s["messages"]) == ["old 0", "old 1", "old 2"]
    assert {s["trajectory_id"] for s in steps} == {"t0", "t1", "t2"} and not left.folder.exists()
    store.close()
