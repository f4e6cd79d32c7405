"""Rendered ids with a real Qwen vocabulary and chat template, and the drift checks around them."""

import subprocess

import anthropic
import openai
import pytest

from stepmill.store import StepRecord, Store
from stepmill.trainer_bridge import load_tokenizer

from stepmill.qwen_vocab import DROP_OLD_THINKING, QWEN_TEMPLATE as KEEP_THINKING
from .conftest import STEPMILL
from stepmill.qwen_vocab import build_qwen_tokenizer, with_template

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def keep_tokenizer(tmp_path_factory):
    return build_qwen_tokenizer(tmp_path_factory.mktemp("qwen-keep"), KEEP_THINKING)


@pytest.fixture(scope="module")
def drop_tokenizer(tmp_path_factory, keep_tokenizer):
    return with_template(keep_tokenizer, tmp_path_factory.mktemp("qwen-drop"), DROP_OLD_THINKING)


def tokenize(db, tokenizer, where, *extra):
    return subprocess.run(STEPMILL + ["tokenize", "--db", str(db), "--tokenizer", str(tokenizer), "--where", where,
                                      *extra], capture_output=True, text=True)


def openai_tool_conversation(trajectory):
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0,
                           default_headers={"X-Stepmill-Trajectory": trajectory})
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="gpt-test", messages=messages, tools=[TOOL]).choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "21C"}]
    client.chat.completions.create(model="gpt-test", messages=messages, tools=[TOOL])


def anthropic_conversation(trajectory, *, follow_up: str | None = None):
    """With thinking; the second turn answers a tool call, or asks a new question (follow_up)."""
    client = anthropic.Anthropic(api_key="sk-ant", base_url="https://api.anthropic.com", max_retries=0,
                                 default_headers={"X-Stepmill-Trajectory": trajectory})
    tools = [] if follow_up else [{"name": "get_weather", "input_schema": {"type": "object"}}]
    kwargs = dict(model="claude-test", max_tokens=500, thinking={"type": "enabled", "budget_tokens": 100})
    if tools:
        kwargs["tools"] = tools
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(messages=messages, **kwargs)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    if follow_up:
        messages.append({"role": "user", "content": follow_up})
    else:
        tool_use = next(b for b in first.content if b.type == "tool_use")
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "21C"}]})
    client.messages.create(messages=messages, **kwargs)


def test_render_captured_tool_conversations(proxy, keep_tokenizer, marker):
    openai_tool_conversation(f"tok-oa-{marker}")
    anthropic_conversation(f"tok-an-{marker}")
    steps = proxy.trajectory_steps(f"tok-oa-{marker}", 2) + proxy.trajectory_steps(f"tok-an-{marker}", 2)
    done = tokenize(proxy.db, keep_tokenizer, f"s.trajectory_id IN ('tok-oa-{marker}', 'tok-an-{marker}')",
                    "--batch-size", "3")
    assert done.returncode == 0, done.stderr
    assert "rendered 4 steps" in done.stderr
    tokenizer = load_tokenizer(str(keep_tokenizer))
    store = proxy.store()
    for before in steps:
        step = store.step(before["step_id"])
        assert step["token_provenance"] == "rendered"
        assert step["token_check"]["tokenizer"] == str(keep_tokenizer)
        assert step["token_check"]["fidelity"] == "ok", step["token_check"]["fidelity_detail"]
        prompt = tokenizer.decode(step["prompt_ids"])
        assert prompt.endswith("<|im_start|>assistant\n")
        assert "# Tools" in prompt and "get_weather" in prompt
        response = tokenizer.decode(step["response_ids"])
        assert response.endswith("<|im_end|>")
        if step["step_index"] == 0:
            assert "<tool_call>" in response and '"get_weather"' in response
            assert step["token_check"]["consistency"] == "root"
        else:
            assert step["token_check"]["consistency"] == "consistent"
    first_anthropic = store.step(steps[2]["step_id"])
    assert "<think>\nLet me look at the weather tool.\n</think>" in tokenizer.decode(first_anthropic["response_ids"])


def test_template_that_drops_old_thinking_is_caught(proxy, drop_tokenizer, marker):
    anthropic_conversation(f"drift-{marker}", follow_up="And tomorrow?")
    parent, child = proxy.trajectory_steps(f"drift-{marker}", 2)
    done = tokenize(proxy.db, drop_tokenizer, f"s.trajectory_id = 'drift-{marker}'")
    assert done.returncode == 0, done.stderr
    store = proxy.store()
    parent, child = store.step(parent["step_id"]), store.step(child["step_id"])
    tokenizer = load_tokenizer(str(drop_tokenizer))
    assert tokenizer.decode(parent["response_ids"]).startswith("<think>")
    check = child["token_check"]
    assert check["consistency"] == "divergent"
    assert check["divergence_pos"] == len(parent["prompt_ids"])  # where the dropped <think> was
    assert "<think>" not in tokenizer.decode(child["prompt_ids"])


def _exact_parent_store(path, keep_tokenizer):
    """A parent step with exact ids (as an engine sampled them, thinking included) and a child without."""
    tokenizer = load_tokenizer(str(keep_tokenizer))
    store = Store(path)
    user = {"role": "user", "content": "What is 2+2?"}
    answer = {"role": "assistant", "content": "4", "reasoning_content": "Add them."}
    prompt = tokenizer.encode(tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    response = tokenizer.encode("<think>\nAdd them.\n</think>\n\n4<|im_end|>", add_special_tokens=False)
    parent = store.record_step(StepRecord(api="openai.chat", trajectory_id="splice", messages=[user], completion=answer,
                                          prompt_ids=prompt, response_ids=response, token_provenance="exact"))
    child = store.record_step(StepRecord(api="openai.chat", trajectory_id="splice",
                                         messages=[user, answer, {"role": "user", "content": "And 3+3?"}],
                                         completion={"role": "assistant", "content": "6"}))
    store.close()
    return parent, child, prompt + response


def test_splice_keeps_exact_parent_ids(tmp_path, keep_tokenizer, drop_tokenizer):
    parent, child, exact = _exact_parent_store(tmp_path / "splice.db", keep_tokenizer)
    done = tokenize(tmp_path / "splice.db", drop_tokenizer, "1", "--splice")
    assert done.returncode == 0, done.stderr
    step = Store(tmp_path / "splice.db").step(child)
    assert step["token_provenance"] == "spliced"
    assert step["prompt_ids"][: len(exact)] == exact and step["token_check"]["spliced_len"] == len(exact)
    assert step["token_check"]["consistency"] == "consistent"
    text = load_tokenizer(str(drop_tokenizer)).decode(step["prompt_ids"][len(exact):])
    assert text == "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"

    # Without splicing the same template re-renders history and the child no longer continues its parent.
    _, child2, _ = _exact_parent_store(tmp_path / "plain.db", keep_tokenizer)
    assert tokenize(tmp_path / "plain.db", drop_tokenizer, "1").returncode == 0
    plain = Store(tmp_path / "plain.db").step(child2)
    assert plain["token_provenance"] == "rendered" and plain["token_check"]["consistency"] == "divergent"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    Store(tmp_path / "x.db").close()
    done = tokenize(tmp_path / "x.db", tmp_path / "no-such-tokenizer", "1")
    assert done.returncode != 0 and "no tokenizer at" in done.stderr and "never downloads" in done.stderr
    assert "Traceback" not in done.stderr
    from stepmill.errors import ConfigError
    from stepmill.trainer_bridge.render import load_tokenizer

    with pytest.raises(ConfigError, match="no tokenizer at"):  # a configuration the user gave, said as one
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))
    with pytest.raises(ConfigError, match="no tokenizer at"):  # a folder without a usable one
        load_tokenizer(str(tmp_path))


def _mixed_store(path):
    """An exact-id step (engine-sampled) and a rendered-to-be step in another trajectory."""
    store = Store(path)
    user = {"role": "user", "content": "q"}
    exact = store.record_step(StepRecord(api="openai.chat", trajectory_id="engine", messages=[user],
                                         completion={"role": "assistant", "content": "a"}, prompt_ids=[1, 2],
                                         response_ids=[3], token_provenance="exact"))
    other = store.record_step(StepRecord(api="openai.chat", trajectory_id="hosted", messages=[user],
                                         completion={"role": "assistant", "content": "b"}))
    store.close()
    return exact, other


def test_where_with_or_never_reaches_exact_ids(tmp_path, keep_tokenizer):
    exact, other = _mixed_store(tmp_path / "m.db")
    done = tokenize(tmp_path / "m.db", keep_tokenizer, "s.trajectory_id = :t OR 1", "--redo", "-p", "t", "hosted")
    assert done.returncode == 0, done.stderr
    store = Store(tmp_path / "m.db")
    assert store.step(exact)["prompt_ids"] == [1, 2] and store.step(exact)["token_provenance"] == "exact"
    assert store.step(other)["token_provenance"] == "rendered"


def test_failed_redo_leaves_no_ids_under_the_new_tokenizer_name(tmp_path, keep_tokenizer):
    exact, other = _mixed_store(tmp_path / "r.db")
    assert tokenize(tmp_path / "r.db", keep_tokenizer, "1").returncode == 0
    broken = with_template(keep_tokenizer, tmp_path / "broken", "{{ raise_exception('template cannot render') }}")
    done = tokenize(tmp_path / "r.db", broken, "1", "--redo")
    assert done.returncode == 0 and "1 failed" in done.stderr
    step = Store(tmp_path / "r.db").step(other)
    assert step["prompt_ids"] is None and step["token_provenance"] == "none"
    assert step["token_check"]["tokenizer"] == str(broken) and step["token_check"]["fidelity"] == "failed"
    assert "template cannot render" in step["token_check"]["fidelity_detail"]


def test_child_stored_before_its_parent_had_ids_is_checked_later(tmp_path):
    store = Store(tmp_path / "c.db")
    user = [{"role": "user", "content": "q"}]
    parent = store.record_step(StepRecord(api="anthropic.messages", trajectory_id="t", messages=user,
                                          completion={"role": "assistant", "content": "a"}))
    child = store.record_step(StepRecord(api="openai.chat", trajectory_id="t",
                                         messages=user + [{"role": "assistant", "content": "a"}],
                                         prompt_ids=[1, 2, 3, 4], response_ids=[5], token_provenance="exact"))
    assert store.step(child)["token_check"]["consistency"] is None  # nothing to compare with yet
    store.set_tokens(parent, [1, 2], [3], provenance="rendered")
    cold = Store(tmp_path / "c.db").step(child)
    assert cold["prompt_ids"] == [1, 2, 3, 4] and cold["token_check"]["consistency"] == "consistent"
    store.set_tokens(parent, [1, 9], [3], provenance="rendered")
    again = Store(tmp_path / "c.db").step(child)
    assert again["token_check"]["consistency"] == "divergent" and again["token_check"]["divergence_pos"] == 1
