"""Exact ids from SGLang, per request the way the server allows: its sglext flags on chat (it refuses
return_token_ids on streamed chat), return_token_ids on completions; nothing it adds reaches the agent.
No SGLang build runs on these machines (its CPU backend is built from source), so the test upstream
reproduces SGLang's shapes: ``sglang.local`` in tests/upstream.py."""

import json

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
