"""A rollout whose agent cannot fit the engine's context is refused before its first run, with the numbers:
the engine (the simulated LLM, which names its context in /v1/models as vLLM does) says max_model_len, the
recipe its opening prompt's size, [run] max_new_tokens what a call may add."""

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .conftest import STEPMILL

MAX_MODEL_LEN = 32768  # what the simulated LLM says, as the tiny Qwen2 on vLLM does


TOOL_LOOP = '["{python}", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]'


def _config(tmp_path, base_url: str, prompt_tokens: int, max_new_tokens: int | None, *, command: str = TOOL_LOOP,
            env: str = "{}", proxy=None, dataset: str = "fit", n: int = 1):
    """A rollout of one agent (``command``, ``env``: TOML) on one task; its own database, or ``proxy``'s."""
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "prompt": "What is 2 + 2?", "answer": "4"}\n')
    db, confdir = (proxy.db, proxy.confdir) if proxy else (tmp_path / "steps.db", tmp_path / "mitm")
    where = (f'url = "{proxy.url}"\n' if proxy else "") + f'db = "{db}"\nconfdir = "{confdir}"'
    config = tmp_path / "rollout.toml"
    config.write_text(f"""
[proxy]
{where}

[route]
base_url = "{base_url}"

[[agent]]
name = "big-prompt"
command = {command}
env = {env}
prompt_tokens = {prompt_tokens}

[[dataset]]
name = "{dataset}"
path = "tasks.jsonl"

[run]
agent = "big-prompt"
dataset = "{dataset}"
n = {n}
model = "qwen-sim"
{f"max_new_tokens = {max_new_tokens}" if max_new_tokens else ""}
""")
    return config


def test_an_agent_that_cannot_fit_is_refused_before_its_first_run(simulated_llm, tmp_path):
    prompt = MAX_MODEL_LEN - 1000
    config = _config(tmp_path, simulated_llm.url, prompt, 2000)
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    said = done.stderr
    assert "'big-prompt' cannot fit the engine's context" in said, said
    assert f"{prompt} tokens" in said and f"{prompt + 2000} in all" in said and f"max_model_len {MAX_MODEL_LEN}" in said
    assert not (tmp_path / "steps.db").exists()  # refused before the proxy started: nothing ran


def test_an_agent_that_fits_or_an_engine_that_names_no_context_is_let_through(simulated_llm, tmp_path):
    from stepmill.runner.config import load
    from stepmill.runner.context_fit import check_context_fit

    check_context_fit(load(_config(tmp_path, simulated_llm.url, MAX_MODEL_LEN - 2000, 2000)))  # exactly fits
    # an engine that cannot be asked (nothing listens there) is not judged: the runs say what happens
    check_context_fit(load(_config(tmp_path, "http://127.0.0.1:9/v1", 10 * MAX_MODEL_LEN, 2000)))


def test_without_max_new_tokens_an_opening_prompt_that_leaves_no_room_is_refused(simulated_llm, tmp_path):
    from stepmill.errors import ConfigError
    from stepmill.runner.config import load
    from stepmill.runner.context_fit import check_context_fit

    check_context_fit(load(_config(tmp_path, simulated_llm.url, MAX_MODEL_LEN - 1, None)))  # one token's room
    with pytest.raises(ConfigError, match=f"a call may add 1 .the least a call adds; .run. max_new_tokens is unset."
                                          f", {MAX_MODEL_LEN + 1} in all"):
        check_context_fit(load(_config(tmp_path, simulated_llm.url, MAX_MODEL_LEN, None)))


@given(set_by_run=st.none() | st.integers(1, 10**6), prompt=st.none() | st.integers(1, 10**6),
       context=st.none() | st.integers(1, 10**6))
def test_what_a_call_may_add_fits_the_context_wherever_the_opening_prompt_does(set_by_run, prompt, context):
    from stepmill.runner.context_fit import DEFAULT_NEW_TOKENS, new_tokens

    adds = new_tokens(set_by_run, prompt, context)
    assert adds >= 1
    if set_by_run:
        assert adds == set_by_run  # the user's own cap, as given (check_context_fit judges it)
    elif context is None:
        assert adds == DEFAULT_NEW_TOKENS
    else:
        assert adds <= DEFAULT_NEW_TOKENS  # never the whole rest of the context: the next call must fit too
        room = context - prompt if prompt else context // 2  # no prompt_tokens stated: half the context
        assert adds == max(1, min(DEFAULT_NEW_TOKENS, room))
        if prompt and prompt < context:
            assert prompt + adds <= context  # what fits is never refused by check_context_fit


def _capped_run(tmp_path, proxy, base_url: str, marker: str) -> list[str]:
    """A rollout of an agent that prints its {max_new_tokens}, from its command and its environment; what
    each run printed."""
    config = _config(tmp_path, base_url, 30000, None, command='["sh", "-c", "echo cap=$0 env=$CAP", "{max_new_tokens}"]',
                     env='{ CAP = "{max_new_tokens}" }', proxy=proxy, dataset=f"cap-{marker}", n=2)
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=120)
    assert "2 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    trajectories = proxy.store().query("SELECT metadata FROM trajectories WHERE id LIKE ?", [f"cap-{marker}-%"])
    return [Path(json.loads(t["metadata"])["workdir"], "agent.log").read_text().strip() for t in trajectories]


def test_a_run_gets_what_the_engine_context_leaves_as_its_output_cap(simulated_llm, proxy, marker, tmp_path):
    from stepmill.runner.context_fit import DEFAULT_NEW_TOKENS

    left = MAX_MODEL_LEN - 30000  # the simulated engine's context less the agent's prompt_tokens
    assert left < DEFAULT_NEW_TOKENS
    assert _capped_run(tmp_path, proxy, simulated_llm.url, marker) == [f"cap={left} env={left}"] * 2
    # an engine that names no context (nothing listens there): the default
    said = _capped_run(tmp_path, proxy, "http://127.0.0.1:9/v1", marker + "-none")
    assert said == [f"cap={DEFAULT_NEW_TOKENS} env={DEFAULT_NEW_TOKENS}"] * 2


# vLLM's /v1/models with a LoRA adapter loaded (serving_models.py): the adapter's card names its base as its
# parent and has no length of its own.
VLLM_MODELS_WITH_ADAPTER = {"object": "list", "data": [
    {"id": "qwen", "object": "model", "owned_by": "vllm", "root": "/models/qwen", "parent": None,
     "max_model_len": 4096, "permission": []},
    {"id": "qwen-run1", "object": "model", "owned_by": "vllm", "root": "/runs/lora-3", "parent": "qwen",
     "max_model_len": None, "permission": []}]}


def test_an_adapters_context_is_its_base_models():
    """A rollout calling a LoRA adapter by name (stepmill train's [train.lora]) is judged by its base's context."""
    import http.server
    import threading

    from stepmill.runner.context_fit import engine_context

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(VLLM_MODELS_WITH_ADAPTER).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        assert engine_context(base_url, "qwen-run1") == 4096
        assert engine_context(base_url, "qwen") == 4096
        assert engine_context(base_url, "unknown") is None  # two models, none of that name: not judged
    finally:
        server.shutdown()
