"""Exact token ids from a vLLM-like engine: captured as sent, hidden from the agent that did not ask."""

import json

import openai
import pytest

from .upstream import END, encode_text, fake_logprobs, render_ids


@pytest.fixture
def engine(proxy):
    return openai.OpenAI(api_key="sk-x", base_url="https://engine.local/v1", max_retries=0)


def _expected(messages, answer):
    return render_ids(messages), encode_text(answer) + [END]


def test_plain_call_ids_and_clean_response(proxy, engine, marker):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"ids {marker}"}]
    raw = engine.chat.completions.with_raw_response.create(model="qwen-engine", messages=messages)
    body = json.loads(raw.text)
    sent = next(r for r in reversed(proxy.upstream.requests) if marker in json.dumps(r))
    assert sent["return_token_ids"] is True and sent["logprobs"] is True  # the proxy asked the engine
    assert body.get("prompt_token_ids") is None and body["choices"][0].get("token_ids") is None  # the agent never sees it
    assert body["choices"][0]["logprobs"] is None
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    prompt, response = _expected(messages, f"Echo: ids {marker}")
    assert step["token_provenance"] == "exact"
    assert step["prompt_ids"] == prompt and step["response_ids"] == response
    assert step["logprobs"] == pytest.approx(fake_logprobs(len(response)), abs=1e-6)
    assert step["token_check"]["consistency"] == "root"


def test_streamed_ids_arrive_per_chunk(proxy, engine, marker):
    messages = [{"role": "user", "content": f"stream ids {marker}"}]
    chunks = list(engine.chat.completions.create(model="qwen-engine", messages=messages, stream=True))
    for chunk in chunks:
        assert (chunk.model_extra or {}).get("prompt_token_ids") is None
        for choice in chunk.choices:
            assert (choice.model_extra or {}).get("token_ids") is None and choice.logprobs is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"Echo: stream ids {marker}"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    prompt, response = _expected(messages, f"Echo: stream ids {marker}")
    assert step["transport"] == "sse"
    assert step["prompt_ids"] == prompt and step["response_ids"] == response
    assert step["logprobs"] == pytest.approx(fake_logprobs(len(response)), abs=1e-6)


def test_what_the_agent_asked_for_stays(proxy, engine, marker):
    reply = engine.chat.completions.create(model="qwen-engine", logprobs=True, stream=True,
                                           messages=[{"role": "user", "content": f"lp {marker}"}])
    chunks = list(reply)
    assert any(c.choices and c.choices[0].logprobs for c in chunks), "the agent asked for logprobs: they stay"
    assert all((c.choices[0].model_extra or {}).get("token_ids") is None for c in chunks if c.choices)
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["response_ids"][-1] == END


def _two_turns(engine, first_text):
    messages = [{"role": "user", "content": first_text}]
    answer = engine.chat.completions.create(model="qwen-engine", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    engine.chat.completions.create(model="qwen-engine", messages=messages)


def test_cross_turn_consistency(proxy, engine, marker):
    _two_turns(engine, f"consistent {marker}")
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    parent, child = proxy.trajectory_steps(root["trajectory_id"], 2)
    assert child["token_check"]["consistency"] == "consistent"
    assert child["prompt_ids"][: len(parent["prompt_ids"]) + len(parent["response_ids"])] == \
        parent["prompt_ids"] + parent["response_ids"]


def test_text_that_re_encodes_differently_is_found(proxy, engine, marker):
    """The engine sampled a token the re-encoded history will not reproduce."""
    _two_turns(engine, f"[[drift]] {marker}")
    root = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])[0]
    parent, child = proxy.trajectory_steps(root["trajectory_id"], 2)
    check = child["token_check"]
    assert check["consistency"] == "divergent"
    assert check["divergence_pos"] == len(parent["prompt_ids"])  # the first response token
    assert str(parent["response_ids"][0]) in check["divergence_reason"]
    stats = proxy.store().stats()
    assert 0 < stats["consistent_share"] < 1 and stats["exact_id_share"] > 0


def test_fifty_turn_ids_stored_once(tmp_path, upstream):
    from .conftest import start_proxy, stop_proxy

    own = start_proxy(tmp_path, upstream)
    try:
        client = openai.OpenAI(api_key="sk-x", base_url=f"http://127.0.0.1:{own.reverse_port}/t/ids/v1", max_retries=0)
        messages = [{"role": "user", "content": "start " * 20}]
        for turn in range(50):
            answer = client.chat.completions.create(model="qwen-engine", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"observation {turn}: " + "data " * 40}]
        steps = own.trajectory_steps("ids", 50)
        last = steps[-1]
        assert last["prompt_ids"] == render_ids(messages[:-2])  # the last request, before its answer
        store = own.store()
        stored = store.query("SELECT sum(length(prompt_suffix) + length(response_ids)) / 4 AS n FROM steps")[0]["n"]
        last_ids = len(last["prompt_ids"]) + len(last["response_ids"])
        print(f"last step {last_ids} ids, stored {stored} ids ({stored / last_ids:.2f}x)")
        assert stored <= 3 * last_ids
        assert {s["token_check"]["consistency"] for s in steps[1:]} == {"consistent"}
    finally:
        stop_proxy(own)
