"""`stepmill score`: reward functions from a TOML file over trajectories captured through the proxy."""

import json
import subprocess

import openai
import pytest

from .conftest import STEPMILL
from .test_capture_openai_chat import WEATHER_TOOL


def _run_agent(proxy, trajectory_id: str, answer: str):
    """A tool loop (tool call, tool result, final answer) tagged with its trajectory."""
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", max_retries=0,
                           default_headers={"X-Stepmill-Trajectory": trajectory_id})
    messages = [{"role": "user", "content": "What is 6 times 7? Use the tool."}]
    reply = client.chat.completions.create(model="gpt-test", messages=messages, tools=[WEATHER_TOOL])
    call = reply.choices[0].message.tool_calls[0]
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "ok: 42" if answer == "42" else "Error: boom"},
                 {"role": "user", "content": f"no tools: so the answer is \\boxed{{{answer}}}"}]
    client.chat.completions.create(model="gpt-test", messages=messages, tools=[WEATHER_TOOL])


@pytest.fixture
def scored_db(proxy, marker, tmp_path):
    client = proxy.client()
    ids = {}
    for answer in ("42", "41"):
        run = client.start_trajectory(trajectory_id=f"math-{answer}-{marker}",
                                      metadata={"answer": "42", "dataset": "gsm8k"})
        _run_agent(proxy, run["trajectory_id"], answer)
        proxy.trajectory_steps(run["trajectory_id"], 2)
        client.complete_trajectory(run["trajectory_id"])
        ids[answer] = run["trajectory_id"]
    config = tmp_path / "rewards.toml"
    config.write_text(f"""
[[reward]]
name = "math-{marker}"
function = "stepmill.rewards.functions:math_answer"
where = {{ "metadata.dataset" = "gsm8k" }}

[[reward]]
name = "boxed-{marker}"
function = "stepmill.rewards.functions:regex_match"
options = {{ pattern = "boxed\\\\{{\\\\d+\\\\}}" }}

[[reward]]
name = "json-{marker}"
function = "stepmill.rewards.functions:json_valid"

[[reward]]
name = "tools-{marker}"
function = "stepmill.rewards.functions:tool_success_rate"

[[reward]]
name = "judge-{marker}"
function = "stepmill.rewards.functions:llm_judge"
source = "model"
options = {{ base_url = "http://127.0.0.1:{proxy.reverse_port}/v1", model = "judge-test", rubric = "Is the answer right?" }}

[[reward]]
name = "length-{marker}"
function = "tests.reward_fixtures:answer_length"

[[reward]]
name = "broken-{marker}"
function = "tests.reward_fixtures:broken"
""")
    return ids, config


def _score(proxy, config, marker):
    return subprocess.run(STEPMILL + ["score", "--db", str(proxy.db), "--config", str(config), "--where",
                                      "t.id LIKE :m", "-p", "m", f"%{marker}"],
                          capture_output=True, text=True, timeout=120)


def test_score_with_each_shipped_function_and_a_failing_one(proxy, marker, scored_db):
    ids, config = scored_db
    done = _score(proxy, config, marker)
    assert done.returncode == 0, done.stderr
    assert f"broken-{marker}: scored 0, failed 2" in done.stderr and f"math-{marker}: scored 2" in done.stderr
    store = proxy.store()

    def value(trajectory_id, name):
        rows = store.query("SELECT value, details FROM rewards WHERE target_id = ? AND name = ?",
                           [trajectory_id, f"{name}-{marker}"])
        return rows[-1]["value"], json.loads(rows[-1]["details"] or "null")

    assert value(ids["42"], "math")[0] == 1.0 and value(ids["41"], "math") == (0.0, {"expected": "42", "extracted": "41"})
    assert value(ids["42"], "boxed")[0] == 1.0 and value(ids["42"], "json")[0] == 0.0
    assert value(ids["42"], "tools")[0] == 1.0 and value(ids["41"], "tools")[0] == 0.0
    assert value(ids["42"], "judge")[0] == 0.8 and value(ids["42"], "length")[0] == 1.0
    broken = value(ids["42"], "broken")
    assert broken[0] is None and "cannot score" in broken[1]["error"]
    # the effective reward is the latest value; failures never count
    assert store.trajectory(ids["42"])["reward"] == 1.0
    again = _score(proxy, config, marker)
    assert f"math-{marker}: scored 0" in again.stderr and f"broken-{marker}: scored 0, failed 2" in again.stderr


def test_a_bad_configuration_names_the_key(proxy, tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[[reward]]\nname = "x"\nfunction = "stepmill.rewards.functions:math_answer"\nsourc = "rule"\n')
    done = subprocess.run(STEPMILL + ["score", "--db", str(proxy.db), "--config", str(config)],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "unknown key 'sourc'" in done.stderr
    config.write_text('[[reward]]\nname = "x"\nfunction = "no.such.module:f"\n')
    done = subprocess.run(STEPMILL + ["score", "--db", str(proxy.db), "--config", str(config)],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "cannot be loaded" in done.stderr
