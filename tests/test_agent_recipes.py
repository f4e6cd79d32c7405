"""The agent CLI recipes (stepmill/data/agent-recipes.toml) through the runner and the real proxy,
against the simulated LLM: Claude Code (Anthropic Messages), Codex (Responses over SSE), mini-swe-agent
and Aider (chat completions via litellm), Qwen Code and OpenCode (streamed chat completions), Gemini CLI
(Gemini's generateContent, which the proxy serves through the engine's chat completions).
`.ci/install-agents` puts them in .agents/."""

import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import STEPMILL

ROOT = Path(__file__).parent.parent
BINARIES = {
    "claude-code": ("claude", ROOT / ".agents" / "node_modules" / ".bin" / "claude"),
    "codex": ("codex", ROOT / ".agents" / "node_modules" / ".bin" / "codex"),
    "mini-swe-agent": ("mini", ROOT / ".agents" / "mini" / "bin" / "mini"),
    "qwen-code": ("qwen", ROOT / ".agents" / "node_modules" / ".bin" / "qwen"),
    "opencode": ("opencode", ROOT / ".agents" / "node_modules" / ".bin" / "opencode"),
    "aider": ("aider", ROOT / ".agents" / "aider" / "bin" / "aider"),
    "gemini-cli": ("gemini", ROOT / ".agents" / "node_modules" / ".bin" / "gemini"),
}
# What each step records: the protocol the agent spoke. The simulated LLM is an engine (it says so in
# /v1/models), so Claude Code's Messages calls and Gemini CLI's generateContent calls are served through its
# chat completions, for exact ids: their steps' engine_api is openai.chat (ENGINE_APIS).
APIS = {"claude-code": "anthropic.messages", "codex": "openai.responses", "mini-swe-agent": "openai.chat",
        "qwen-code": "openai.chat", "opencode": "openai.chat", "aider": "openai.chat",
        "gemini-cli": "gemini.generate"}
ENGINE_APIS = {"claude-code": "openai.chat", "gemini-cli": "openai.chat"}


def recipe(name: str) -> str:
    """One [[agent]] table of the shipped recipes, as written there."""
    text = (importlib.resources.files("stepmill") / "data" / "agent-recipes.toml").read_text()
    blocks = text.split("[[agent]]")[1:]
    found = [b for b in blocks if re.search(rf'^name = "{re.escape(name)}"', b, re.M)]
    assert len(found) == 1, name
    return "[[agent]]" + found[0]


def binary(name: str) -> str | None:
    command, bundled = BINARIES[name]
    return str(bundled) if bundled.exists() else shutil.which(command)


def run_recipe(name: str, proxy, base_url: str, model: str, marker: str, tmp_path, *, tasks: int, timeout: int,
               agent_edit=lambda text: text):
    """A shipped recipe through `stepmill rollout` (n=2 on the first bundled tasks) against ``base_url``:
    what the runner printed, the trajectories, and everything to read when it fails (the agents' logs)."""
    path = binary(name)
    if path is None:
        pytest.skip(f"{BINARIES[name][0]} is not installed (.ci/install-agents installs it)")
    command = BINARIES[name][0]
    agent = agent_edit(recipe(name).replace(f'command = ["{command}"', f'command = ["{path}"', 1)
                       .replace(f', "{command}", ', f', "{path}", ', 1))  # a CLI a shell line starts
    bundled = (importlib.resources.files("stepmill") / "data" / "arith20.jsonl").read_text().splitlines()
    (tmp_path / "tasks.jsonl").write_text("\n".join(bundled[:tasks]) + "\n")
    config = tmp_path / "rollout.toml"
    config.write_text(f"""[proxy]
url = "{proxy.url}"
db = "{proxy.db}"
confdir = "{proxy.confdir}"

[route]
base_url = "{base_url}"

{agent}

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

[[reward]]
name = "math"
function = "stepmill.rewards.functions:math_answer"
""")
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=600)
    trajectories = proxy.store().query("SELECT id, metadata, reward, status FROM trajectories WHERE id LIKE ?",
                                       [f"{name}-{marker}-%"])
    logs = [Path(json.loads(t["metadata"])["workdir"], "agent.log") for t in trajectories]
    detail = done.stderr + "".join(f"\n--- {log}\n{log.read_text()[-1500:]}" for log in logs if log.exists())
    return done, trajectories, detail


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(BINARIES))
def test_recipe_through_the_runner(name, proxy, simulated_llm, marker, tmp_path):
    done, trajectories, detail = run_recipe(name, proxy, simulated_llm.url, "qwen-sim", marker, tmp_path,
                                            tasks=2, timeout=180)
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
