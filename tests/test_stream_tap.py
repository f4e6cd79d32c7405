"""The stream tap: bytes reach the agent whole, whatever the chunking, encoding or event size.

mitmproxy sends what the tap returns; an empty chunk ends an HTTP/1 body, so the tap must never
return one, and a rewritten stream must be exactly the upstream's events minus the engine fields.
"""

import gzip
import json
import re
import zlib

import brotli
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmill.addon import engine
from stepmill.protocols import anthropic_messages
from stepmill.protocols import openai_chat
from stepmill.protocols import openai_responses
from stepmill.protocols.sse import SSEDecoder
from stepmill.addon.stream_tap import StreamTap
from stepmill.protocols.streams import assemble

try:
    from compression.zstd import compress as zstd_compress
except ImportError:
    from backports.zstd import compress as zstd_compress

ADDED = engine.Added(token_ids=True, logprobs=True)
ID_VALUES = re.compile(rb'"(?:prompt_)?token_ids":\s*\[')  # ids with values; null is how vLLM answers unasked


def chat_events(text="Hello there", prompt_ids=(1, 2, 3), big=0):
    first = {"id": "c1", "model": "m", "prompt_token_ids": list(prompt_ids) + list(range(big)),
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    events = [first]
    for i, piece in enumerate(text[j:j + 4] for j in range(0, len(text), 4)):
        events.append({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"content": piece},
                                                              "token_ids": [100 + i], "logprobs": None,
                                                              "finish_reason": None}]})
    events.append({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return events


def sse(events, done=True, sep=b"\n\n"):
    body = b"".join(b"data: " + json.dumps(e).encode() + sep for e in events)
    return body + (b"data: [DONE]" + sep if done else b"")


def stripped(events):
    out = []
    for e in events:
        e = json.loads(json.dumps(e))
        engine.strip(e, ADDED)
        out.append(e)
    return out


def run(tap, chunks):
    """What the agent receives: every returned chunk, checked to be non-empty."""
    sent = []
    for chunk in list(chunks) + [b""]:
        result = tap(chunk)
        assert isinstance(result, list), "the tap returns a list of chunks"
        assert all(isinstance(c, bytes) and c for c in result), "never an empty chunk: it would end the body"
        sent += result
    return b"".join(sent)


def received_events(body):
    decoder = SSEDecoder()
    return [e.data for e in decoder.push(body) + decoder.flush() if e.data]


def rewriting_tap(encoding=None):
    return StreamTap(rewrite=lambda p: engine.strip(p, ADDED), markers=engine.MARKERS, content_encoding=encoding)


def reassembled(tap, module=openai_chat):
    """What the writer makes of what the tap kept (the upstream's bytes, as they came)."""
    return assemble(module.StreamAssembler(), bytes(tap.raw), tap.marks, tap.content_encoding)


def cuts(data, points):
    points = sorted({p % (len(data) + 1) for p in points})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def test_every_single_split_point_of_a_rewritten_stream():
    events = chat_events()
    body = sse(events)
    want = [json.dumps(e, separators=(",", ":")) for e in stripped(events)] + ["[DONE]"]
    for cut in range(1, len(body)):
        tap = rewriting_tap()
        out = run(tap, [body[:cut], body[cut:]])
        got = received_events(out)
        assert [json.loads(g) if g != "[DONE]" else g for g in got] == [json.loads(w) if w != "[DONE]" else w for w in want]
        completion = reassembled(tap).completion
        assert completion.status == "ok" and completion.message["content"] == "Hello there"
        assert completion.prompt_ids == [1, 2, 3]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(points=st.lists(st.integers(min_value=0, max_value=10**6), max_size=30),
       encoding=st.sampled_from([None, "gzip", "deflate", "br", "zstd"]),
       rewrite=st.booleans(), crlf=st.booleans())
def test_random_chunking_and_encodings(points, encoding, rewrite, crlf):
    events = chat_events()
    plain = sse(events, sep=b"\r\n\r\n" if crlf else b"\n\n")
    body = {None: lambda b: b, "gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
            "zstd": zstd_compress}[encoding](plain)
    tap = rewriting_tap(encoding) if rewrite else StreamTap(content_encoding=encoding)
    out = run(tap, cuts(body, points))
    if rewrite:  # decoded, engine fields gone, every event there
        assert not ID_VALUES.search(out)  # the id fields reach the agent as vLLM sends them unasked: null
        assert len(received_events(out)) == len(events) + 1
    else:  # untouched
        assert out == body
    result = reassembled(tap)
    assert result.completion.status == "ok" and result.completion.message["content"] == "Hello there"
    assert result.completion.response_ids == [100, 101, 102] and result.terminal
    assert result.first_output_at is not None


def test_a_huge_first_event_in_small_chunks():
    """60k prompt ids in the first event (what stepmill asks vLLM for), arriving 1 KiB at a time."""
    events = chat_events(big=60000)
    body = sse(events)
    tap = rewriting_tap()
    out = run(tap, [body[i:i + 1024] for i in range(0, len(body), 1024)])
    assert len(received_events(out)) == len(events) + 1 and not ID_VALUES.search(out)
    assert len(reassembled(tap).completion.prompt_ids) == 60003


def test_linear_time_for_one_large_event():
    """An 8 MB event in 16 KiB chunks is searched once, not re-scanned per chunk."""
    import time

    payload = b"data: " + b"x" * (8 * 1024 * 1024) + b"\n\n"
    decoder = SSEDecoder()
    started = time.perf_counter()
    found = []
    for i in range(0, len(payload), 16384):
        found += decoder.push(payload[i:i + 16384])
    assert len(found) == 1 and len(found[0].data) == 8 * 1024 * 1024
    assert time.perf_counter() - started < 5  # quadratic re-scanning took minutes


def test_broken_compressed_stream_never_sends_compressed_bytes_as_plain():
    body = gzip.compress(sse(chat_events()))
    broken = body[:30] + b"\x00garbage\xff" * 4 + body[30:]
    tap = rewriting_tap("gzip")
    out = run(tap, cuts(broken, [10, 40, 80]))
    assert b"\x1f\x8b" not in out  # the gzip magic never reaches an agent told the body is plain
    assert any("decompress" in n for n in tap.notes)
    assert reassembled(tap).completion.status != "ok"


def test_unknown_encoding_passes_bytes_through_untouched():
    tap = StreamTap(rewrite=lambda p: engine.strip(p, ADDED), markers=engine.MARKERS, content_encoding="compress")
    assert not tap.rewriting  # so the caller keeps the Content-Encoding header
    body = b"opaque bytes \x00\x01"
    assert run(tap, [body[:5], body[5:]]) == body


@pytest.mark.parametrize("module,events", [
    (anthropic_messages, [("message_start", {"type": "message_start", "message": {"id": "msg_1", "model": "m"}}),
                          ("message_stop", {"type": "message_stop"})]),
    (openai_responses, [("response.completed", {"type": "response.completed",
                                                "response": {"id": "resp_1", "status": "completed", "output": []}})]),
])
def test_terminal_event_is_seen(module, events):
    body = b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events)
    tap = StreamTap()
    run(tap, [body[:-3]])
    assert not reassembled(tap, module).terminal
    run(tap, [body[-3:]])
    assert reassembled(tap, module).terminal


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_arbitrary_bytes_never_raise_and_always_pass(body, points):
    tap = StreamTap()
    assert run(tap, cuts(body, points)) == body
    rewriting = rewriting_tap()
    run(rewriting, cuts(body, points))
    for module in (openai_chat, anthropic_messages, openai_responses):
        reassembled(tap, module)
        reassembled(rewriting, module)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([b"data: ", b"data:", b"event: x\n", b": keep-alive\n", b"\n", b"\n\n",
                                           b"\r\n", b"{\"a\": 1}", b"[DONE]", b"id: 7\n"]),
                          st.binary(max_size=8)), max_size=30))
def test_the_whole_body_split_agrees_with_the_incremental_decoder(parts):
    from stepmill.protocols.sse import events_of

    body = b"".join(parts)
    decoder = SSEDecoder()
    incremental = [(e.event, e.data) for e in decoder.push(body) + decoder.flush() if e.data]
    whole = [(name, data) for _, name, data in events_of(body)]
    assert whole == incremental
    ends = [end for end, _, _ in events_of(body)]
    assert ends == sorted(ends) and all(0 < end <= len(body) for end in ends)


# The writer parses each event with the JSON scanner and hands the value to ``feed_parsed``; an
# assembler fed the raw text event by event must end with the same completion.
_TEXT = st.text(max_size=6)
_CHAT_DELTA = st.fixed_dictionaries({}, optional={
    "role": st.just("assistant"), "content": _TEXT, "reasoning_content": _TEXT,
    "tool_calls": st.lists(st.fixed_dictionaries({"index": st.integers(0, 2)}, optional={
        "id": _TEXT, "function": st.fixed_dictionaries({}, optional={"name": _TEXT, "arguments": _TEXT})}),
        max_size=2)})
_CHAT_CHUNK = st.fixed_dictionaries({"id": st.just("c1")}, optional={
    "choices": st.lists(st.fixed_dictionaries({"index": st.integers(0, 1), "delta": _CHAT_DELTA}, optional={
        "finish_reason": st.sampled_from([None, "stop", "tool_calls"]), "token_ids": st.lists(st.integers(0, 9))}),
        max_size=2),
    "usage": st.just({"prompt_tokens": 3, "completion_tokens": 2})})
_ANTHROPIC_EVENT = st.one_of(
    st.fixed_dictionaries({"type": st.just("content_block_start"), "index": st.integers(0, 2),
                           "content_block": st.sampled_from([{"type": "text", "text": "A"}, {"type": "thinking"},
                                                             {"type": "tool_use", "id": "t", "name": "f"}])}),
    st.fixed_dictionaries({"type": st.just("content_block_delta"), "index": st.integers(0, 2),
                           "delta": st.one_of(
                               st.fixed_dictionaries({"type": st.just("text_delta"), "text": _TEXT}),
                               st.fixed_dictionaries({"type": st.just("thinking_delta"), "thinking": _TEXT}),
                               st.fixed_dictionaries({"type": st.just("signature_delta"), "signature": _TEXT}),
                               st.fixed_dictionaries({"type": st.just("input_json_delta"),
                                                      "partial_json": st.sampled_from(['{"a"', ': 1}', ''])}))}),
    st.fixed_dictionaries({"type": st.just("content_block_stop"), "index": st.integers(0, 2)}),
    st.just({"type": "message_stop"}),
)
_RESPONSES_EVENT = st.one_of(
    st.fixed_dictionaries({"type": st.just("response.output_text.delta"), "output_index": st.integers(0, 1),
                           "delta": _TEXT}),
    st.just({"type": "response.completed", "response": {"id": "r", "status": "completed", "output": []}}),
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.tuples(st.just(openai_chat), st.lists(_CHAT_CHUNK, max_size=8)),
                 st.tuples(st.just(anthropic_messages), st.lists(_ANTHROPIC_EVENT, max_size=12)),
                 st.tuples(st.just(openai_responses), st.lists(_RESPONSES_EVENT, max_size=6))),
       st.booleans())
def test_the_writers_parsed_events_assemble_as_the_raw_ones(case, done):
    module, events = case
    datas = [json.dumps(e, ensure_ascii=False) for e in events] + (["[DONE]"] if done else [])
    by_text = module.StreamAssembler()
    for data in datas:
        try:
            by_text.feed(None, data)
        except Exception:
            pass
    body = b"".join(b"data: " + d.encode() + b"\n\n" for d in datas)
    result = assemble(module.StreamAssembler(), body, [(len(body), 1.0)], None)
    expected = by_text.finish()
    assert (result.completion.message, result.completion.wire, result.completion.finish_reason) == \
        (expected.message, expected.wire, expected.finish_reason)


def test_anthropic_deltas_are_joined_in_order():
    events = [{"type": "message_start", "message": {"id": "m", "model": "claude"}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
              *({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": f"t{i} "}}
                for i in range(3000)),
              {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}},
              {"type": "content_block_stop", "index": 0},
              {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": "Hi"}},
              *({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": f" {i}"}}
                for i in range(3000)),
              {"type": "content_block_stop", "index": 1},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn"}},
              {"type": "message_stop"}]
    body = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
    completion = assemble(anthropic_messages.StreamAssembler(), body, [(len(body), 1.0)], None).completion
    thinking, text = completion.wire[0]["content"]
    assert thinking == {"type": "thinking", "thinking": "".join(f"t{i} " for i in range(3000)), "signature": "sig"}
    assert text == {"type": "text", "text": "Hi" + "".join(f" {i}" for i in range(3000))}
    assert completion.status == "ok" and completion.finish_reason == "end_turn"
