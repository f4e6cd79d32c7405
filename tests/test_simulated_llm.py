"""The simulated LLM the demo runs on: vLLM's protocol and token-id fields with the real Qwen2
vocabulary, through the real proxy; right and wrong by a seeded coin; bad requests get clear errors."""

import json
import ssl

import httpx2
import openai
import pytest
from hypothesis import given, settings, strategies as st
from transformers import PreTrainedTokenizerFast

from stepmill.agents.tool_loop import CALCULATOR
from stepmill.simulated_llm import SimulatedPolicy, find_expression

from .conftest import http_json


@pytest.fixture(scope="module")
def qwen(simulated_llm):
    return PreTrainedTokenizerFast.from_pretrained(str(simulated_llm.tokenizer))


def _through_proxy(proxy, simulated_llm) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    http = httpx2.Client(proxy=proxy.url, verify=verify, timeout=30, trust_env=False)
    return openai.OpenAI(api_key="sk-local", base_url=simulated_llm.url, http_client=http, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_exact_qwen_ids_through_the_proxy(proxy, simulated_llm, qwen, marker, stream):
    """The proxy finds the engine by its /v1/models, asks for ids, strips them from what the agent sees,
    and records ids that are the real Qwen2 encoding of the chat template's text."""
    client = _through_proxy(proxy, simulated_llm)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"[{marker}] What is 6 * 7?"}]
    reply = client.chat.completions.create(model="qwen-sim", messages=messages, tools=[CALCULATOR], stream=stream)
    if stream:
        chunks = list(reply)
        assert all((c.model_extra or {}).get("prompt_token_ids") is None for c in chunks)
        assert all((choice.model_extra or {}).get("token_ids") is None for c in chunks for choice in c.choices)
    else:
        assert (reply.model_extra or {}).get("prompt_token_ids") is None
        assert (reply.choices[0].model_extra or {}).get("token_ids") is None
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "ok" and step["token_provenance"] == "exact", step
    rendered = qwen.apply_chat_template(messages, tools=[CALCULATOR], add_generation_prompt=True, tokenize=False)
    assert step["prompt_ids"] == qwen.encode(rendered, add_special_tokens=False)
    assert step["response_ids"][-1] == qwen.convert_tokens_to_ids("<|im_end|>")
    sampled = qwen.decode(step["response_ids"][:-1])
    completion = step["completion"]
    if completion.get("tool_calls"):
        call = completion["tool_calls"][0]["function"]
        assert sampled == f'<tool_call>\n{{"name": "calculator", "arguments": {call["arguments"]}}}\n</tool_call>'
        assert json.loads(call["arguments"]) == {"expression": "6 * 7"}
    else:
        assert sampled == completion["content"]
    assert step["logprobs"] and len(step["logprobs"]) == len(step["response_ids"])


def test_token_in_token_out_completions(simulated_llm, qwen):
    ids = qwen.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    status, body = http_json("POST", f"{simulated_llm.url}/completions",
                             {"model": "m", "prompt": ids, "return_token_ids": True, "logprobs": 0})
    assert status == 200
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids
    assert qwen.decode(choice["token_ids"]) == choice["text"] + "<|im_end|>"
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert body["system_fingerprint"] == "stepmill-simulated"  # labelled in every answer
    status, models = http_json("GET", f"{simulated_llm.url}/models")
    assert models["data"][0]["owned_by"] == "vllm" and "simulated" in models["data"][0]["description"]


@pytest.mark.parametrize("path,body,message", [
    ("/completions", {"prompt": [10 ** 7]}, "outside the vocabulary"),
    ("/completions", {"prompt": {"x": 1}}, "prompt must be"),
    ("/chat/completions", {"messages": []}, "messages must be"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 99}, "n must be"),
    ("/nowhere", {}, "no route"),
])
def test_bad_requests_get_clear_errors(simulated_llm, path, body, message):
    status, answer = http_json("POST", simulated_llm.url + path, body)
    assert status in (400, 404) and message in answer["error"]["message"]


def test_rollouts_of_one_prompt_differ_and_a_rerun_repeats_them():
    prompt = "<|im_start|>user\nWhat is 17 * 23 + 4?<|im_end|>\n<|im_start|>assistant\n"
    first = SimulatedPolicy(seed=3).reply(prompt, tools=False).text
    policy = SimulatedPolicy(seed=3)
    replies = [policy.reply(prompt, tools=False).text for _ in range(40)]
    assert replies[0] == first  # the k-th ask of a prompt gets the k-th coin of its seed
    answers = {r.rsplit("{", 1)[-1] for r in replies}
    assert "395}" in answers and len(answers) > 1  # sometimes right, sometimes wrong
    again = SimulatedPolicy(seed=3)
    assert [again.reply(prompt, tools=False).text for _ in range(40)] == replies


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_find_expression_never_fails(text):
    found = find_expression(text)
    assert found is None or any(op in found for op in "+-*/")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 999), min_size=2, max_size=5), st.lists(st.sampled_from("+-*"), min_size=4, max_size=4),
       st.sampled_from(["What is {}?", "Compute {}.", "A shop: {} items"]))
def test_find_expression_finds_the_task(numbers, operators, wording):
    expression = str(numbers[0]) + "".join(f" {o} {n}" for o, n in zip(operators, numbers[1:]))
    assert find_expression(wording.format(expression)) == expression


BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_for_claude_code(proxy, simulated_llm, marker, stream):
    """What Claude Code needs: Messages with a shell tool, streamed or not, through the proxy."""
    import anthropic

    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    http = httpx2.Client(proxy=proxy.url, verify=verify, timeout=30, trust_env=False)
    client = anthropic.Anthropic(api_key="sk-ant-local", base_url=simulated_llm.url.removesuffix("/v1"),
                                 http_client=http, max_retries=0)
    messages = [{"role": "user", "content": f"[{marker}] What is 12 * 12?"}]
    seen = set()
    for _ in range(12):  # the coin picks the tool or a direct answer; both shapes must come out whole
        if stream:
            with client.messages.stream(model="claude-sim", max_tokens=256, messages=messages, tools=[BASH]) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(model="claude-sim", max_tokens=256, messages=messages, tools=[BASH])
        kinds = [block.type for block in message.content]
        if message.stop_reason == "tool_use":
            call = next(b for b in message.content if b.type == "tool_use")
            assert call.name == "Bash" and call.input == {"command": "python3 -c 'print(12 * 12)'"}
            last_call = (message, call)
        else:
            assert message.stop_reason == "end_turn" and kinds == ["text"] and "\\boxed{" in message.content[0].text
        seen.add(message.stop_reason)
        if len(seen) == 2:
            break
    assert seen == {"tool_use", "end_turn"}
    # An engine host: each Messages call went to its chat completions, asked for ids; the agent got
    # Messages back (above), the step holds the exact ids the engine sampled.
    steps = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], count=2)
    assert {(s["api"], s["engine_api"]) for s in steps} == {("anthropic.messages", "openai.chat")}
    assert {s["status"] for s in steps} == {"ok"} and {s["token_provenance"] for s in steps} == {"exact"}
    # The tool's result goes back as Claude Code sends it: the next step continues the tool call's step.
    message, call = last_call
    follow = messages + [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                       "content": [{"type": "text", "text": "144"}]}]}]
    answer = client.messages.create(model="claude-sim", max_tokens=256, messages=follow, tools=[BASH])
    assert answer.stop_reason in ("end_turn", "tool_use")
    [after] = proxy.steps("s.messages_suffix LIKE ?", [f"%{call.id}%"])
    assert after["parent_step_id"] and after["token_provenance"] == "exact", after
    store = proxy.store()
    assert store.query("SELECT consistency FROM steps WHERE id = ?", [after["step_id"]])[0]["consistency"] == \
        "consistent"


def test_responses_for_codex(proxy, simulated_llm, marker):
    """What Codex needs: Responses over SSE, a function call with its argv, then the answer to its output."""
    client = _through_proxy(proxy, simulated_llm)
    shell = {"type": "function", "name": "shell", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}
    inputs = [{"role": "user", "content": f"[{marker}] What is 3 * (400 - 256) + 12?"}]
    for _ in range(12):
        with client.responses.stream(model="qwen-sim", input=inputs, tools=[shell]) as stream:
            final = stream.get_final_response()
        calls = [item for item in final.output if item.type == "function_call"]
        if calls:
            break
    assert calls, "the coin never chose the tool in 12 tries"
    assert json.loads(calls[0].arguments) == {"command": ["bash", "-lc", "python3 -c 'print(3 * (400 - 256) + 12)'"]}
    inputs += [{"type": "function_call", "call_id": calls[0].call_id, "name": "shell", "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Exit code: 0\nOutput:\n444\n"}]
    answer = client.responses.create(model="qwen-sim", input=inputs, tools=[shell])
    assert "\\boxed{" in answer.output_text and "444" in answer.output_text
    steps = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], count=2)
    assert {s["api"] for s in steps} == {"openai.responses"} and {s["status"] for s in steps} == {"ok"}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_get_exact_ids_from_an_engine(proxy, simulated_llm, marker, stream):
    """Responses to an engine: the proxy asks for vLLM's raw_message_tokens (enable_response_messages),
    records them as the step's exact ids, and the agent sees the fields as the engine answers when
    nobody asked (empty)."""
    client = _through_proxy(proxy, simulated_llm)
    inputs = [{"role": "user", "content": f"[{marker}] What is 6 * 7?"}]
    if stream:
        with client.responses.stream(model="qwen-sim", input=inputs) as events:
            seen = [event.model_dump() for event in events]
        assert not any((e.get("response") or {}).get("input_messages") for e in seen)
        assert not any((e.get("response") or {}).get("output_messages") for e in seen)
    else:
        reply = client.responses.create(model="qwen-sim", input=inputs)
        assert (reply.model_extra or {}).get("input_messages") is None
        assert (reply.model_extra or {}).get("output_messages") is None
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["token_provenance"] == "exact" and step["prompt_ids"] and step["response_ids"]
    asked = simulated_llm_engine(simulated_llm)
    prompt = asked.render([{"role": "user", "content": f"[{marker}] What is 6 * 7?"}], [])
    assert step["prompt_ids"] == asked.encode(prompt)


def simulated_llm_engine(simulated_llm):
    from stepmill.simulated_llm import SimulatedModel, SimulatedPolicy

    return SimulatedModel(str(simulated_llm.tokenizer), SimulatedPolicy())
