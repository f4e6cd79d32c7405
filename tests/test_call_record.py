"""The record the event loop hands to the pipeline: to the journal's bytes and back; an entry that is no
record of this version is refused, not guessed at."""

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
    assert back.to_header()["version"] == VERSION
    assert back_blobs == blobs


def test_a_header_of_another_shape_is_refused():
    import pytest

    for header in ({"kind": "http", "api": "openai.chat", "host": "h", "path": "/p"},  # flat: no version
                   {"version": 1, "kind": "http", "call": {"api": "openai.chat"}}, {"version": VERSION, "call": "x"},
                   ["not", "a", "dict"]):
        with pytest.raises(ValueError):
            CallRecord.from_header(header)
