"""Property-based: mutations of real bodies through the parsers and into a real SQLite store.

Whatever an agent or an engine sends (odd types, integers past 2^63, lone surrogates, non-integer
token ids), the call becomes exactly one step per choice or one error step with its raw bytes;
nothing raises and nothing is lost.
"""

import copy
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmill.pipeline import recording
from stepmill.protocols import anthropic_messages
from stepmill.protocols import gemini_generate
from stepmill.protocols import openai_chat
from stepmill.protocols import openai_responses
from stepmill.protocols import by_api
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.addon.stream_tap import StreamTap
from stepmill.protocols.streams import assemble
from stepmill.store import Store

CHAT_REQUEST = {"model": "qwen", "temperature": 0.2, "tools": [{"type": "function", "function": {
    "name": "f", "parameters": {"type": "object"}}}], "messages": [
    {"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"}]}
CHAT_RESPONSE = {"id": "chatcmpl-1", "model": "qwen", "prompt_token_ids": [1, 2, 3],
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok", "tool_calls": None},
                              "finish_reason": "stop", "token_ids": [4, 5],
                              "logprobs": {"content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]}},
                             {"index": 1, "message": {"role": "assistant", "content": "also"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}}
ANTHROPIC_REQUEST = {"model": "claude", "max_tokens": 10, "system": [{"type": "text", "text": "sys"}], "messages": [
    {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r"}]}]}]}
ANTHROPIC_RESPONSE = {"id": "msg_1", "type": "message", "model": "claude", "stop_reason": "end_turn",
                      "content": [{"type": "text", "text": "done"}, {"type": "tool_use", "id": "t2", "name": "f", "input": {"x": 1}}],
                      "usage": {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 1}}
RESPONSES_REQUEST = {"model": "gpt-5", "instructions": "sys", "previous_response_id": None, "input": [
    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "r"}]}
RESPONSES_RESPONSE = {"id": "resp_1", "model": "gpt-5", "status": "completed", "output": [
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
    "usage": {"input_tokens": 3, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 1}}}
GEMINI_REQUEST = {"systemInstruction": {"parts": [{"text": "sys"}]}, "contents": [
    {"role": "user", "parts": [{"text": "hi"}]},
    {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": "c2ln"}]},
    {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"output": "42"}}}]}],
    "tools": [{"functionDeclarations": [{"name": "f", "parametersJsonSchema": {"type": "object"}}]}],
    "generationConfig": {"temperature": 0, "thinkingConfig": {"includeThoughts": True}}}
GEMINI_RESPONSE = {"candidates": [{"index": 0, "finishReason": "STOP", "content": {"role": "model", "parts": [
    {"text": "thinking", "thought": True}, {"text": "ok"}, {"functionCall": {"name": "f", "args": {}}}]}}],
    "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2, "cachedContentTokenCount": 1},
    "modelVersion": "gemini-2.5-pro", "responseId": "r1"}
CASES = [(openai_chat, openai_chat.CHAT, CHAT_REQUEST, CHAT_RESPONSE),
         (gemini_generate, gemini_generate.API, GEMINI_REQUEST, GEMINI_RESPONSE),
         (anthropic_messages, anthropic_messages.API, ANTHROPIC_REQUEST, ANTHROPIC_RESPONSE),
         (openai_responses, openai_responses.API, RESPONSES_REQUEST, RESPONSES_RESPONSE)]

NASTY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
              st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def mutate(value, path, new):
    if not path:
        return new
    value = copy.deepcopy(value)
    target = value
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return value


@st.composite
def mutated(draw, body):
    out = body
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        options = list(paths(out))
        out = mutate(out, draw(st.sampled_from(options)), draw(NASTY))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store(tmp_path_factory.mktemp("fuzz") / "fuzz.db")


def _record(store, module, api, raw_request: bytes, response):
    protocol = by_api(api)
    request, _, parse_error = recording.parse_request(protocol, raw_request)
    if isinstance(response, dict):
        completion = recording.parse_response(protocol, response)
    else:
        completion = recording.parse_response(protocol, {"unexpected": response})
    raw_response = json.dumps(response).encode()
    before = store.query("SELECT coalesce(max(rowid), 0) AS n FROM steps")[0]["n"]
    messages = request.messages if request else []
    wire = request.wire_messages if request else []
    record = CallRecord(kind="http", call=Call(api=api, host="h", path="/p"), started=time.time(),
                        ended=time.time(), response_started=time.time(), http_status=200)
    layer = recording.record_call(store, record, [raw_request, raw_response], request, parse_error, completion,
                                  messages, wire)
    assert layer in ("full", "parsed", "bare")
    rows = store.query("SELECT status, raw_request, raw_response, error FROM steps WHERE rowid > ? ORDER BY rowid",
                       [before])
    assert rows, "the call became a step"
    assert len(rows) == (1 + len(completion.alternatives) if layer == "full" else 1)  # all choices or one error
    if parse_error or layer != "full":
        assert {row["status"] for row in rows} == {"error"}
    if parse_error or completion.status != "ok" or layer != "full":
        assert rows[0]["raw_request"] is not None and rows[0]["raw_response"] is not None, "raw bytes kept"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data(), case=st.sampled_from(CASES))
def test_mutated_requests_and_responses_never_lose_a_call(store, data, case):
    module, api, request, response = case
    bad_request = data.draw(mutated(request))
    bad_response = data.draw(mutated(response))
    raw = json.dumps(bad_request).encode()  # lone surrogates travel as \\ud800 escapes, as in real bodies
    _record(store, module, api, raw, bad_response)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), case=st.sampled_from(CASES))
def test_mutated_stream_events_never_raise(store, data, case):
    module, api, _, response = case
    events = [data.draw(mutated(response)) for _ in range(data.draw(st.integers(1, 4)))]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    tap = StreamTap()
    assert tap(body) == [body]
    tap(b"")
    completion = assemble(module.StreamAssembler(api), bytes(tap.raw), tap.marks, None).completion
    record = CallRecord(kind="sse", call=Call(api=api, host="h", path="/p"), started=time.time(), ended=time.time(),
                        http_status=200)
    layer = recording.record_call(store, record, [b"{}", body], None, None, completion, [], [])
    assert layer in ("full", "parsed", "bare")
