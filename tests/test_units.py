"""Small pure pieces: SSE decoding across chunk borders, tagging, engine routing, prefix deltas."""

import base64

import numpy as np

from stepmill.addon import engine, tagging
from stepmill.addon.sse import SSEDecoder
from stepmill.store.sequences import split_against


def test_sse_events_split_anywhere():
    stream = b'event: a\ndata: {"x": 1}\n\n: keep-alive\n\ndata: line1\ndata: line2\r\n\r\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        decoder = SSEDecoder()
        events = decoder.push(stream[:cut]) + decoder.push(stream[cut:]) + decoder.flush()
        data = [e.data for e in events if e.data]
        assert data == ['{"x": 1}', "line1\nline2", "[DONE]"], cut
        assert b"".join(e.raw for e in events) == stream


def test_sse_last_event_without_blank_line_counts():
    decoder = SSEDecoder()
    assert decoder.push(b"data: tail") == []
    assert [e.data for e in decoder.flush()] == ["tail"]


def test_tag_path_and_credentials():
    tags, rest = tagging.split_tag_path("/t/run%201/g/grp/v1/chat/completions")
    assert (tags.trajectory_id, tags.group_id, rest) == ("run 1", "grp", "/v1/chat/completions")
    assert tagging.split_tag_path("/v1/chat/completions") is None
    header = "Basic " + base64.b64encode(b"traj:group").decode()
    assert tagging.from_proxy_authorization(header) == tagging.Tags("traj", "group")
    assert tagging.from_proxy_authorization("Basic !!!") is None
    assert tagging.from_proxy_authorization(None) is None


def test_identifying_headers_drop_secrets_and_transport():
    kept = tagging.identifying_headers({"Authorization": "Bearer x", "x-api-key": "k", "Cookie": "c",
                                        "Content-Length": "12", "User-Agent": "claude-cli/1.0",
                                        "anthropic-beta": "tools"})
    assert kept == {"user-agent": "claude-cli/1.0", "anthropic-beta": "tools"}


def test_engine_routing():
    assert engine.is_engine("10.0.0.7", 8000, "openai.chat", "auto")
    assert not engine.is_engine("api.openai.com", 443, "openai.chat", "auto")
    assert not engine.is_engine("openrouter.ai", 443, "openai.chat", "auto")
    assert not engine.is_engine("10.0.0.7", 8000, "openai.responses", "auto")
    assert not engine.is_engine("10.0.0.7", 8000, "openai.chat", "none")
    assert engine.is_engine("gpu1", 8000, "openai.chat", "gpu1:8000,gpu2")
    assert not engine.is_engine("gpu3", 8000, "openai.chat", "gpu1:8000,gpu2")


def test_engine_inject_only_what_is_missing():
    body = {"logprobs": True}
    added = engine.inject(body, "openai.chat")
    assert body == {"logprobs": True, "return_token_ids": True} and added.token_ids and not added.logprobs
    payload = {"prompt_token_ids": [1], "choices": [{"token_ids": [2], "logprobs": {"content": []}}]}
    assert engine.strip(payload, added)
    assert payload == {"choices": [{"logprobs": {"content": []}}]}


def test_split_against_lists_and_arrays():
    assert split_against([1, 2, 3], None) == (0, [1, 2, 3])
    assert split_against([1, 2, 3, 4], [1, 2, 9]) == (2, [3, 4])
    k, rest = split_against(np.array([1, 2, 3]), np.array([1, 2]))
    assert k == 2 and rest.tolist() == [3]


def test_stream_tap_reads_compressed_streams_and_passes_bytes_on():
    import gzip
    import json

    from stepmill.addon.protocols import openai_chat
    from stepmill.addon.stream_tap import StreamTap

    events = [{"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
              for piece in ("Hel", "lo")]
    events.append({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    raw = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
    body = gzip.compress(raw)
    tap = StreamTap(openai_chat.StreamAssembler(), content_encoding="gzip")
    passed = b"".join(tap(body[i:i + 7]) for i in range(0, len(body), 7)) + tap(b"")
    assert passed == body  # untouched on the way to the agent
    completion = tap.finish()
    assert completion.message["content"] == "Hello" and completion.status == "ok"


def test_stream_tap_rewrites_whole_events_only():
    import json

    from stepmill.addon import engine
    from stepmill.addon.protocols import openai_chat
    from stepmill.addon.stream_tap import StreamTap

    first = {"id": "c", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [3]}]}
    last = {"id": "c", "choices": [{"index": 0, "delta": {}, "token_ids": [4], "finish_reason": "stop"}]}
    raw = f"data: {json.dumps(first)}\n\ndata: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode()
    added = engine.Added(token_ids=True)
    tap = StreamTap(openai_chat.StreamAssembler(), rewrite=lambda p: engine.strip(p, added))
    out = b"".join(tap(raw[i:i + 5]) for i in range(0, len(raw), 5)) + tap(b"")
    assert b"token_ids" not in out and out.endswith(b"data: [DONE]\n\n")
    completion = tap.finish()
    assert completion.prompt_ids == [1, 2] and completion.response_ids == [3, 4]
