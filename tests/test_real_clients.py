"""Real clients against engines through the real proxy: streams arrive whole, and a stream whose
last event arrived is `ok` even when the client closes (or resets its HTTP/2 stream) before the
upstream ends the body, as the openai SDK and Codex do."""

import json
import ssl
import time

import httpx2
import openai
import pytest

from .upstream import END, LINGER, encode_text, render_ids


def _engine(proxy, mode: str, http2: bool = False) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    if mode == "forward":  # HTTPS through the proxy: the client negotiates HTTP/2 with mitmproxy when asked
        http = httpx2.Client(proxy=proxy.url, verify=verify, http2=http2, timeout=30)
        return openai.OpenAI(api_key="sk-x", base_url="https://engine.local/v1", http_client=http, max_retries=0)
    # reverse mode: the agent only takes a base URL; over TLS to the reverse port it can offer HTTP/2
    scheme = "https" if http2 else "http"
    http = httpx2.Client(verify=verify, http2=http2, timeout=30, trust_env=False)  # straight to the reverse port
    return openai.OpenAI(api_key="sk-x", base_url=f"{scheme}://127.0.0.1:{proxy.reverse_port}/v1",
                         http_client=http, max_retries=0)


@pytest.mark.parametrize("mode,http2", [("forward", False), ("forward", True), ("reverse", False), ("reverse", True)],
                         ids=["forward-http1", "forward-http2", "reverse-http1", "reverse-http2"])
@pytest.mark.parametrize("shape", ["split-", "gzip-", "br-", ""])
def test_engine_streams_reach_the_agent_whole(proxy, marker, mode, http2, shape):
    """Engine fields are stripped from every event, whatever the network cut the events into."""
    client = _engine(proxy, mode, http2)
    text = f"stream {shape or 'plain'} {mode} {marker}"
    chunks = list(client.chat.completions.create(model=f"{shape}qwen-engine", stream=True,
                                                 messages=[{"role": "user", "content": text}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"Echo: {text}"
    assert chunks[-1].choices[0].finish_reason == "stop"
    for chunk in chunks:
        assert (chunk.model_extra or {}).get("prompt_token_ids") is None
        assert all((c.model_extra or {}).get("token_ids") is None for c in chunk.choices)
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "ok", step["error"]
    assert step["token_provenance"] == "exact"
    assert step["response_ids"] == encode_text(f"Echo: {text}") + [END]


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_huge_first_event(proxy, marker, mode):
    """60k prompt ids in the first event (what stepmill asks vLLM for) reach nobody but the store."""
    client = _engine(proxy, mode)
    prompt = f"big {marker} " + "x" * 60000
    chunks = list(client.chat.completions.create(model="split-qwen-engine", stream=True,
                                                 messages=[{"role": "user", "content": prompt}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"Echo: {prompt[:80]}"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%big {marker}%"])
    assert step["status"] == "ok" and step["prompt_ids"] == render_ids([{"role": "user", "content": prompt}])


def test_sdk_closing_on_done_is_ok(proxy, openai_client, marker):
    """`for chunk in stream` stops at [DONE] and closes; the upstream has not ended the body yet."""
    started = time.time()
    stream = openai_client.chat.completions.create(
        model="gpt-test", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"close early {marker}"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert time.time() - started < LINGER, "the client did not wait for the body to end"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "ok" and step["error"] is None
    assert step["completion"]["content"] == text and step["finish_reason"] == "stop"
    assert step["usage"]["output_tokens"] > 0


def test_responses_stream_closed_on_completed_is_ok(proxy, openai_client, marker):
    """Codex over HTTP: the stream is dropped right after response.completed."""
    with openai_client.responses.stream(model="gpt-5-test", input=f"codex http {marker}") as stream:
        final = stream.get_final_response()
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "ok" and step["response_id"] == final.id


@pytest.mark.parametrize("terminal", [True, False])
def test_http2_stream_reset_after_or_before_the_end(proxy, marker, terminal):
    """An HTTP/2 client resets its stream (CANCEL) after the terminal event: ok. Before it: incomplete."""
    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    model = "gpt-test" if terminal else f"gated-stream-{marker}"  # gated: the rest waits until released
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": f"h2 {terminal} {marker}"}]}
    with httpx2.Client(proxy=proxy.url, verify=verify, http2=True, timeout=30) as client:
        with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=body,
                           headers={"Authorization": "Bearer sk-x"}) as response:
            assert response.http_version == "HTTP/2"
            for line in response.iter_lines():
                if (terminal and line == "data: [DONE]") or (not terminal and line.startswith("data: {")):
                    break  # leaving the block resets the stream
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%h2 {terminal} {marker}%"])
    if terminal:
        assert step["status"] == "ok", step["error"]
    else:
        assert step["status"] == "incomplete"
    proxy.upstream.release(model)


def test_engine_body_with_split_json_response(proxy, marker):
    """A plain (non-streamed) engine reply: ids captured, body clean, sizes consistent."""
    client = _engine(proxy, "forward")
    raw = client.chat.completions.with_raw_response.create(
        model="qwen-engine", messages=[{"role": "user", "content": f"plain {marker}"}])
    body = json.loads(raw.text)
    assert body.get("prompt_token_ids") is None and int(raw.headers["content-length"]) == len(raw.content)
