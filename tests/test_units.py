"""Small pure pieces: SSE decoding across chunk borders, tagging, engine routing, prefix deltas."""

import base64

import numpy as np

from stepmill.addon import engine

from stepmill import tags as tagging
from stepmill.protocols.sse import SSEDecoder
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
    tags = tagging.from_proxy_authorization(header)
    assert (tags.trajectory_id, tags.group_id) == ("traj", "group")
    assert tagging.from_proxy_authorization("Basic !!!") is None
    assert tagging.from_proxy_authorization(None) is None


def test_stored_headers_are_an_allowlist():
    from stepmill.pipeline.redaction import allowed_headers
    from stepmill.pipeline.call_record import Call, CallRecord
    from stepmill.pipeline.handoff import redact_record

    kept = allowed_headers({"Authorization": "Bearer x", "x-api-key": "k", "Cookie": "c", "Content-Length": "12",
                           "User-Agent": "claude-cli/1.0", "anthropic-beta": "tools",
                           "sec-websocket-protocol": "realtime, openai-insecure-api-key.sk-abcdef123456",
                           "ocp-apim-subscription-key": "s1", "helicone-auth": "Bearer sk-helicone-123456",
                           "x-made-up-secret-carrier": "s2"})
    assert kept == {"user-agent": "claude-cli/1.0", "anthropic-beta": "tools"}
    record = redact_record(CallRecord(kind="http", call=Call("a", "h", "/p", headers={"x-title": "app sk-proj-abcdef123456"}),
                                      error="bad key sk-ant-abcdefgh99"))
    assert (record.call.headers, record.error) == ({"x-title": "app [redacted]"}, "bad key [redacted]")


def test_engine_routing():
    assert engine.configured("10.0.0.7", 8000, "openai.chat", "auto") is None  # auto: the probe decides
    assert engine.configured("api.openai.com", 443, "openai.chat", "auto") is False
    assert engine.configured("openrouter.ai", 443, "openai.chat", "auto") is False
    # Responses and Messages too: engines give ids for both (Messages through chat completions).
    assert engine.configured("10.0.0.7", 8000, "openai.responses", "auto") is None
    assert engine.configured("10.0.0.7", 8000, "anthropic.messages", "auto") is None
    assert engine.configured("api.anthropic.com", 443, "anthropic.messages", "auto") is False
    assert engine.configured("10.0.0.7", 8000, "openai.chat", "none") is False
    assert engine.configured("gpu1", 8000, "openai.chat", "gpu1:8000,gpu2") is True
    assert engine.configured("gpu3", 8000, "openai.chat", "gpu1:8000,gpu2") is False
    assert engine.models_say_engine(200, b'{"object":"list","data":[{"id":"q","owned_by":"vllm"}]}')
    assert engine.models_say_engine(200, b'{"data":[{"id":"q","owned_by":"sglang"}]}') == "sglang"
    assert not engine.models_say_engine(200, b'{"data":[{"id":"gpt","owned_by":"openai"}]}')
    assert not engine.models_say_engine(404, b'{"data":[{"owned_by":"vllm"}]}')
    assert not engine.models_say_engine(200, b"<html>")


def test_engine_inject_only_what_is_missing():
    body = {"logprobs": True}
    added = engine.inject(body, "openai.chat")
    assert body == {"logprobs": True, "return_token_ids": True} and added.token_ids and not added.logprobs
    payload = {"prompt_token_ids": [1], "choices": [{"token_ids": [2], "logprobs": {"content": []}}]}
    assert engine.strip(payload, added)
    # What vLLM sends unasked: the id fields, null; the logprobs the agent asked for stay.
    assert payload == {"prompt_token_ids": None, "choices": [{"token_ids": None, "logprobs": {"content": []}}]}
    chunk = {"choices": [{"index": 0, "delta": {}, "token_ids": [7], "finish_reason": None}]}
    assert engine.strip(chunk, added) and chunk == {}  # only the added fields filled it: never sent


def test_split_against_lists_and_arrays():
    assert split_against([1, 2, 3], None) == (0, [1, 2, 3])
    assert split_against([1, 2, 3, 4], [1, 2, 9]) == (2, [3, 4])
    k, rest = split_against(np.array([1, 2, 3]), np.array([1, 2]))
    assert k == 2 and rest.tolist() == [3]


def test_only_sglangs_own_generate_path_is_an_llm_call():
    from stepmill.protocols import match

    assert match("/generate").api == "sglang.generate" and match("/generate?x=1").api == "sglang.generate"
    assert match("/api/generate") is None  # Ollama's, and any other service's, pass untouched
