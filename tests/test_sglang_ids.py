"""Exact ids from SGLang, per request the way the server allows: its sglext flags on chat (it refuses
return_token_ids on streamed chat), return_token_ids on completions; nothing it adds reaches the agent.
No SGLang build runs on these machines (its CPU backend is built from source), so the test upstream
reproduces SGLang's shapes: ``sglang.local`` in tests/upstream.py."""

import json
import ssl

import anthropic
import openai
import pytest

from .upstream import END, encode_text, render_ids


@pytest.fixture
def sglang(proxy):
    return openai.OpenAI(api_key="sk-x", base_url="https://sglang.local/v1", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_ids_come_from_sglext(proxy, sglang, marker, stream):
    messages = [{"role": "user", "content": f"sgl {stream} {marker}"}]
    if stream:
        chunks = list(sglang.chat.completions.create(model="qwen-sgl", messages=messages, stream=True))
        assert all("sglext" not in (chunk.model_extra or {}) for chunk in chunks)
        assert all(chunk.choices for chunk in chunks), "the ids-only chunk never reaches the agent"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        raw = json.loads(sglang.chat.completions.with_raw_response.create(model="qwen-sgl", messages=messages).text)
        assert "sglext" not in raw and "prompt_token_ids" not in raw
        text = raw["choices"][0]["message"]["content"]
    assert text == f"Echo: sgl {stream} {marker}"
    sent = next(r for r in reversed(proxy.upstream.requests) if marker in json.dumps(r))
    assert sent.get("return_input_ids_in_sglext") is True and "return_token_ids" not in sent
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["token_provenance"] == "exact"
    assert step["prompt_ids"] == render_ids(messages) and step["response_ids"] == encode_text(text) + [END]


def test_what_the_agent_asked_of_sglang_stays(proxy, sglang, marker):
    messages = [{"role": "user", "content": f"own {marker}"}]
    raw = sglang.chat.completions.with_raw_response.create(
        model="qwen-sgl", messages=messages, extra_body={"return_output_ids_in_sglext": True})
    assert json.loads(raw.text)["sglext"]["output_ids"] == [encode_text(f"Echo: own {marker}") + [END]]


def test_claude_code_on_sglang_gets_exact_ids(proxy, marker):
    client = anthropic.Anthropic(api_key="sk-ant-x", base_url="https://sglang.local", max_retries=0)
    with client.messages.stream(model="qwen-sgl", max_tokens=64, messages=[
            {"role": "user", "content": f"claude on sgl {marker}"}]) as events:
        message = events.get_final_message()
    assert message.content[0].text == f"Echo: claude on sgl {marker}" and message.stop_reason == "end_turn"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["token_provenance"] == "exact" and step["response_ids"][-1] == END


@pytest.mark.parametrize("stream", [False, True])
def test_native_generate_token_in_token_out(proxy, marker, stream):
    """SGLang's /generate: ids in, [logprob, id, text] out; the proxy asks for return_logprob and
    takes it out again; the step's ids are the ids sent and the ids sampled."""
    import httpx2

    prompt_ids = encode_text(f"tok {stream} {marker}")
    client = httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                           timeout=30, trust_env=False)
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 64}, "stream": stream}
    reply = client.post("https://sglang.local/generate", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        assert events and all("output_token_logprobs" not in e["meta_info"] for e in events)
        text = events[-1]["text"]
    else:
        assert "output_token_logprobs" not in reply.json()["meta_info"]
        text = reply.json()["text"]
    assert text == f"gen: tok {stream} {marker}"
    [step] = proxy.steps("s.api = 'sglang.generate' AND s.completion LIKE ?", [f"%tok {stream} {marker}%"])
    assert step["token_provenance"] == "exact"
    assert step["prompt_ids"] == prompt_ids and step["response_ids"] == encode_text(text) + [END]
    assert step["logprobs"] and len(step["logprobs"]) == len(step["response_ids"])


def test_another_services_generate_is_not_recorded(proxy, marker):
    import httpx2

    client = httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                           timeout=30, trust_env=False)
    reply = client.post("https://api.openai.com/generate", json={"text": f"not ours {marker}"})
    assert reply.status_code == 404  # untouched, answered by that host
    import time

    time.sleep(1)
    assert not proxy.store().query("SELECT id FROM steps WHERE completion LIKE ? OR messages_suffix LIKE ?",
                                   [f"%not ours {marker}%", f"%not ours {marker}%"])
