"""The agent-framework recipes (stepmill/data/framework-recipes.toml), their text as shipped, through the
runner (sandboxed) and the real proxy, against the simulated LLM: the example agents of
stepmill/agents/frameworks on the OpenAI Agents SDK, LangGraph, PydanticAI and smolagents (Python), and
Vercel's AI SDK and Mastra (TypeScript, on Node). `.ci/install-frameworks` installs the frameworks into
.agents/frameworks/; the runner finds each one's interpreter on its PATH, as a user's would be on theirs."""

import importlib.resources
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.agents.tool_loop import run_tool

from .conftest import STEPMILL
from .real_engine import missing
from .test_real_vllm import engine_proxy  # noqa: F401  (the real vLLM behind the real proxy, a fixture)

EXAMPLES = Path(__file__).parent.parent / "stepmill" / "agents" / "frameworks"
FRAMEWORKS = Path(__file__).parent.parent / ".agents" / "frameworks"
# Where each recipe's interpreter is installed (put first on the runner's PATH), and the program it names.
INSTALLS = {"openai-agents": ("openai-agents/bin", "python"), "langgraph": ("langgraph/bin", "python"),
            "pydantic-ai": ("pydantic-ai/bin", "python"), "smolagents": ("smolagents/bin", "python"),
            "ai-sdk": ("node/node_modules/.bin", "node"), "mastra": ("node/node_modules/.bin", "node")}
# smolagents sends its past tool calls and their results back as text, not as tool messages: its calls do
# not continue one another (each is exact, and a root of its own in the run's trajectory).
UNLINKED = {"smolagents"}


def recipe(name: str) -> str:
    """One [[agent]] table of the shipped framework recipes, as written there."""
    text = (importlib.resources.files("stepmill") / "data" / "framework-recipes.toml").read_text()
    tables = [table for table in re.split(r"^(?=\[\[agent\]\])", text, flags=re.M)
              if re.search(rf'^name = "{re.escape(name)}"$', table, re.M)]
    assert len(tables) == 1, f"{name}: {len(tables)} tables"
    return tables[0]


def runner_path(name: str) -> str:
    """The runner's PATH: the framework's install first; the test skips where it is not installed (and
    fails in CI, which installs it)."""
    folder, program = INSTALLS[name]
    path = os.pathsep.join([str(FRAMEWORKS / folder), os.environ.get("PATH", os.defpath)])
    if not (FRAMEWORKS / folder / program).exists():
        missing(f"{name} is not installed (.ci/install-frameworks installs it into {FRAMEWORKS / folder})")
    assert shutil.which(program, path=path) == str(FRAMEWORKS / folder / program)
    return path


def arithmetic_tasks(count: int) -> list[str]:
    """The first ``count`` bundled arithmetic tasks, as JSON lines."""
    return (importlib.resources.files("stepmill") / "data" / "arith20.jsonl").read_text().splitlines()[:count]


def rollout(name: str, proxy, base_url: str, model: str, marker: str, tmp_path, *, tasks: list[str], run: str,
            isolation: str = ""):
    """The shipped recipe through `stepmill rollout` (n=2 on each of ``tasks``; ``run`` and ``isolation``: more
    lines of those tables): what the runner printed, the trajectories, and what to read when it fails (the
    runner's output, the agents' logs)."""
    (tmp_path / "tasks.jsonl").touch(mode=0o600)  # owner-only, as a runner that is not root asks of a dataset
    (tmp_path / "tasks.jsonl").write_text("\n".join(tasks) + "\n")
    config = tmp_path / "rollout.toml"
    config.write_text(f'[proxy]\nurl = "{proxy.url}"\ndb = "{proxy.db}"\nconfdir = "{proxy.confdir}"\n\n'
                      f'[route]\nbase_url = "{base_url}"\n\n{recipe(name)}\n'
                      f'[[dataset]]\nname = "{name}-{marker}"\npath = "tasks.jsonl"\n\n'
                      f'[run]\nagent = "{name}"\ndataset = "{name}-{marker}"\nn = 2\nconcurrency = 2\n'
                      f'model = "{model}"\n{run}\n\n[isolation]\n{isolation}\n\n'
                      '[[reward]]\nname = "math"\nfunction = "stepmill.rewards.functions:math_answer"\n')
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PATH": runner_path(name)})
    trajectories = proxy.store().query("SELECT id, metadata, reward, status FROM trajectories WHERE id LIKE ?",
                                       [f"{name}-{marker}-%"])
    logs = [Path(json.loads(t["metadata"])["workdir"], "agent.log") for t in trajectories]
    detail = done.stderr + "".join(f"\n--- {log}\n{log.read_text()[-2000:]}" for log in logs if log.exists())
    return done, trajectories, detail


def by_trajectory(steps: list[dict]) -> dict[str, list[dict]]:
    """Each trajectory's steps in the order they were made."""
    found: dict[str, list[dict]] = {}
    for step in steps:
        found.setdefault(step["trajectory_id"], []).append(step)
    return {trajectory: sorted(chain, key=lambda s: s["step_index"]) for trajectory, chain in found.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(INSTALLS))
def test_framework_recipe_through_the_runner(name, proxy, simulated_llm, marker, tmp_path):
    done, trajectories, detail = rollout(name, proxy, simulated_llm.url, "qwen-sim", marker, tmp_path,
                                         tasks=arithmetic_tasks(2),
                                         run="timeout = 180\nmax_new_tokens = 1234")
    assert "4 runs finished (0 failed, 0 timed out)" in done.stderr, detail
    assert {json.loads(t["metadata"]).get("isolation") for t in trajectories} == {"sandbox"}, detail
    assert len(trajectories) == 4 and {t["status"] for t in trajectories} == {"complete"}, detail
    assert all(t["reward"] in (0.0, 1.0) for t in trajectories), detail
    steps = proxy.steps("s.trajectory_id LIKE ?", [f"{name}-{marker}-%"], count=4)
    chains = by_trajectory(steps)
    assert len(chains) == 4, detail  # every run's calls carry its own tags
    assert {(s["api"], s["status"], s["token_provenance"]) for s in steps} == {("openai.chat", "ok", "exact")}, detail
    assert {s["params"].get("max_tokens") or s["params"].get("max_completion_tokens") for s in steps} == {1234}
    # The simulated LLM calls the calculator on most tasks: a tool call, its result, then the answer.
    tool_runs = [chain for chain in chains.values() if chain[0]["completion"].get("tool_calls")]
    assert tool_runs, detail
    for chain in tool_runs:
        assert len(chain) >= 2, detail
        if name not in UNLINKED:
            assert chain[1]["parent_step_id"] == chain[0]["step_id"], detail
            assert chain[1]["messages"][-1]["role"] == "tool", chain[1]["messages"]



@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(INSTALLS))
def test_framework_recipe_trusts_the_proxy_over_https(name, proxy, marker, tmp_path):
    """Against an HTTPS API (api.openai.com, which the test proxy sends to the local test upstream), the
    framework's client goes through HTTPS_PROXY and trusts the proxy's CA from the bundle the runner names
    (SSL_CERT_FILE, NODE_EXTRA_CA_CERTS): otherwise its TLS handshake with the proxy fails and no call is
    stored. The upstream answers a task that asks for no tools in text, at once."""
    task = json.dumps({"id": "plain", "prompt": "Reply in words, no tools: what is two and two?", "answer": "4"})
    done, trajectories, detail = rollout(name, proxy, "https://api.openai.com/v1", "gpt-4o-mini", marker, tmp_path,
                                         tasks=[task], run="timeout = 180\nmax_new_tokens = 100",
                                         # where the test proxy really sends api.openai.com's calls
                                         isolation=f'allow_hosts = ["127.0.0.1:{proxy.upstream.port}"]')
    assert "2 runs finished (0 failed, 0 timed out)" in done.stderr, detail
    steps = proxy.steps("s.trajectory_id LIKE ?", [f"{name}-{marker}-%"], count=2)
    assert len(by_trajectory(steps)) == 2, detail
    assert {(s["api"], s["status"], s["host"]) for s in steps} == {("openai.chat", "ok", "api.openai.com")}, detail
    assert all("The tool said" not in json.dumps(s["completion"]) for s in steps)

# --- the TypeScript examples' calculator (shared.mjs parses arithmetic itself) -------------------------------

def arithmetic() -> st.SearchStrategy[str]:
    """Expressions the tool loop's calculator takes: integers, + - * /, small powers, signs, parentheses."""
    numbers = st.integers(0, 999).map(str)

    def grow(inner):
        binary = st.tuples(inner, st.sampled_from(["+", "-", "*", "/"]), inner).map(" ".join)
        power = st.tuples(inner, st.integers(0, 3)).map(lambda pair: f"({pair[0]}) ** {pair[1]}")
        return st.one_of(binary, power, inner.map(lambda e: f"-{e}"), inner.map(lambda e: f"({e})"))

    return st.recursive(numbers, grow, max_leaves=6)


@settings(max_examples=25, deadline=None)
@given(st.lists(arithmetic(), min_size=1, max_size=20))
def test_the_typescript_calculator_agrees_with_the_tool_loop(expressions):
    """What a TypeScript example's calculator answers is what the Python examples' (the tool loop's) does:
    the same number, or an error for both (division by zero)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = ("const { calculate } = await import(process.argv[1]);"
              "console.log(JSON.stringify(JSON.parse(process.argv[2]).map(calculate)));")
    done = subprocess.run([node, "--input-type=module", "-e", script, (EXAMPLES / "shared.mjs").as_uri(),
                           json.dumps(expressions)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for expression, typescript in zip(expressions, json.loads(done.stdout), strict=True):
        python = run_tool("calculator", json.dumps({"expression": expression}))
        if python.startswith("error"):
            assert typescript.startswith("error"), (expression, python, typescript)
        else:
            assert float(typescript) == pytest.approx(float(python), rel=1e-9), (expression, python, typescript)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(INSTALLS))
def test_framework_recipe_against_the_real_vllm(name, engine_proxy, vllm, marker, tmp_path):  # noqa: F811
    """Each recipe as shipped against the real vLLM (random weights: it rarely calls the tool, and its
    answers are noise), every call stored with the ids vLLM sampled. Calls kept short: 64 new tokens."""
    done, trajectories, detail = rollout(name, engine_proxy, vllm.url, vllm.model, marker, tmp_path,
                                         tasks=arithmetic_tasks(1),
                                         run="timeout = 240\nmax_new_tokens = 64")
    assert "2 runs finished (0 failed, 0 timed out)" in done.stderr, detail
    assert {json.loads(t["metadata"]).get("isolation") for t in trajectories} == {"sandbox"}, detail
    steps = engine_proxy.steps("s.trajectory_id LIKE ?", [f"{name}-{marker}-%"], count=2)
    print(name, [(s["trajectory_id"][-2:], s["status"], s["finish_reason"], len(s["response_ids"] or ())) for s in steps])
    assert len(by_trajectory(steps)) == 2, detail
    assert {(s["api"], s["status"], s["token_provenance"]) for s in steps} == {("openai.chat", "ok", "exact")}, detail
    for step in steps:
        assert step["prompt_ids"] and step["response_ids"] and len(step["logprobs"]) == len(step["response_ids"])
        assert len(step["response_ids"]) <= 64
