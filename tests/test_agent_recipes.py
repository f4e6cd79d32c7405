"""The agent CLI recipes (stepmill/data/agent-recipes.toml) through the runner and the real proxy,
against the simulated LLM: Claude Code (Anthropic Messages), Codex (Responses over SSE), mini-swe-agent
and Aider (chat completions via litellm), Qwen Code and OpenCode (streamed chat completions), Gemini CLI
(Gemini's generateContent, which the proxy serves through the engine's chat completions).
`.ci/install-agents` puts them in .agents/; the runner finds them on its PATH. Each recipe runs as shipped,
its text unmodified, every run sandboxed, and its CLI asks the rollout's output cap on every call."""

import importlib.resources
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import STEPMILL

ROOT = Path(__file__).parent.parent
# Where .ci/install-agents puts the CLIs: put before the runner's PATH, as a user's install would be on theirs.
AGENT_BINS = [ROOT / ".agents" / "node_modules" / ".bin", ROOT / ".agents" / "mini" / "bin", ROOT / ".agents" / "aider" / "bin"]
PROGRAMS = {"claude-code": "claude", "codex": "codex", "mini-swe-agent": "mini", "qwen-code": "qwen",
            "opencode": "opencode", "aider": "aider", "gemini-cli": "gemini", "kilo-code": "kilo",
            "cline": "cline"}
# What each step records: the protocol the agent spoke. The simulated LLM is an engine (it says so in
# /v1/models), so Claude Code's Messages calls and Gemini CLI's generateContent calls are served through its
# chat completions, for exact ids: their steps' engine_api is openai.chat (ENGINE_APIS).
APIS = {"claude-code": "anthropic.messages", "codex": "openai.responses", "mini-swe-agent": "openai.chat",
        "qwen-code": "openai.chat", "opencode": "openai.chat", "aider": "openai.chat",
        "gemini-cli": "gemini.generate", "kilo-code": "openai.chat", "cline": "openai.chat"}
ENGINE_APIS = {"claude-code": "openai.chat", "gemini-cli": "openai.chat"}
CAP = 1234  # the rollout's [run] max_new_tokens: the output cap each recipe hands its CLI
UNCAPPED = {"codex", "cline"}  # no setting for it: its calls name no cap, the engine's default applies


def asked_caps(steps: list[dict]) -> set:
    """The output caps a recipe's calls asked the engine for: the stored request's max_tokens, translated
    from Messages' max_tokens and Gemini's maxOutputTokens where the proxy serves those through chat."""
    return {(step["params"] or {}).get("max_tokens") for step in steps}


def asked_greedy(steps: list[dict]) -> list:
    """The calls that asked for greedy decoding (temperature 0): a group of such rollouts is n copies of one
    reply, so every recipe leaves sampling to the engine or samples itself."""
    return [step["step_id"] for step in steps if (step["params"] or {}).get("temperature") == 0]


def caps_wanted(name: str, cap: int) -> set:
    """What ``asked_caps`` must be under ``[run] max_new_tokens = cap``: none named by a CLI without the setting."""
    return {None} if name in UNCAPPED else {cap}


def recipe(name: str) -> str:
    """One [[agent]] table of the shipped recipes, as written there."""
    text = (importlib.resources.files("stepmill") / "data" / "agent-recipes.toml").read_text()
    blocks = text.split("[[agent]]")[1:]
    found = [b for b in blocks if re.search(rf'^name = "{re.escape(name)}"', b, re.M)]
    assert len(found) == 1, name
    return "[[agent]]" + found[0]


def agents_path() -> str:
    """The runner's PATH: the installed CLIs' folders first."""
    return os.pathsep.join([*map(str, AGENT_BINS), os.environ.get("PATH", os.defpath)])


def run_recipe(name: str, proxy, base_url: str, model: str, marker: str, tmp_path, *, tasks: int, timeout: int,
               run_settings: str = ""):
    """A shipped recipe, its text as shipped, through `stepmill rollout` (n=2 on the first bundled tasks)
    against ``base_url``, the CLIs on the runner's PATH; ``run_settings``: more of the rollout's ``[run]``
    table. What the runner printed, the trajectories, and everything to read when it fails (the agents' logs)."""
    if shutil.which(PROGRAMS[name], path=agents_path()) is None:
        pytest.skip(f"{PROGRAMS[name]} is not installed (.ci/install-agents installs it)")
    bundled = (importlib.resources.files("stepmill") / "data" / "arith20.jsonl").read_text().splitlines()
    (tmp_path / "tasks.jsonl").write_text("\n".join(bundled[:tasks]) + "\n")
    config = tmp_path / "rollout.toml"
    config.write_text(f"""[proxy]
url = "{proxy.url}"
db = "{proxy.db}"
confdir = "{proxy.confdir}"

[route]
base_url = "{base_url}"

{recipe(name)}

[[dataset]]
name = "{name}-{marker}"
path = "tasks.jsonl"

[run]
agent = "{name}"
dataset = "{name}-{marker}"
n = 2
concurrency = 2
timeout = {timeout}
model = "{model}"
{run_settings}

[[reward]]
name = "math"
function = "stepmill.rewards.functions:math_answer"
""")
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PATH": agents_path()})
    trajectories = proxy.store().query("SELECT id, metadata, reward, status FROM trajectories WHERE id LIKE ?",
                                       [f"{name}-{marker}-%"])
    logs = [Path(json.loads(t["metadata"])["workdir"], "agent.log") for t in trajectories]
    detail = done.stderr + "".join(f"\n--- {log}\n{log.read_text()[-1500:]}" for log in logs if log.exists())
    return done, trajectories, detail


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_recipe_through_the_runner(name, proxy, simulated_llm, marker, tmp_path):
    done, trajectories, detail = run_recipe(name, proxy, simulated_llm.url, "qwen-sim", marker, tmp_path,
                                            tasks=2, timeout=180, run_settings=f"max_new_tokens = {CAP}")
    assert "4 runs finished (0 failed, 0 timed out)" in done.stderr, detail
    assert {json.loads(t["metadata"]).get("isolation") for t in trajectories} == {"sandbox"}, detail
    assert len(trajectories) == 4 and {t["status"] for t in trajectories} == {"complete"}
    assert all(t["reward"] in (0.0, 1.0) for t in trajectories), detail
    steps = proxy.steps("s.trajectory_id LIKE ?", [f"{name}-{marker}-%"], count=4)
    by_trajectory = {}
    for step in steps:
        by_trajectory.setdefault(step["trajectory_id"], []).append(step)
    assert len(by_trajectory) == 4, detail  # every run's calls carry its own tags
    # A tool call (and its result) before the answer makes more steps; an answer at once, one.
    tool_runs = [t for t, s in by_trajectory.items() if len(s) >= 2]
    for trajectory in tool_runs:
        chain = sorted(by_trajectory[trajectory], key=lambda s: s["step_index"])
        assert chain[0]["completion"].get("tool_calls") and chain[1]["parent_step_id"] == chain[0]["step_id"]
    assert {(s["api"], s["engine_api"]) for s in steps} == {(APIS[name], ENGINE_APIS.get(name))}
    assert {s["status"] for s in steps} == {"ok"}
    assert {s["token_provenance"] for s in steps} == {"exact"}, detail  # every agent, every step
    assert asked_caps(steps) == caps_wanted(name, CAP), detail  # the rollout's cap reached every call as the CLI sent it
    assert not asked_greedy(steps), detail  # every call samples: a group of greedy replies has nothing to learn
