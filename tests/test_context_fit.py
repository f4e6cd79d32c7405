"""A rollout whose agent cannot fit the engine's context is refused before its first run, with the numbers:
the engine (the simulated LLM, which names its context in /v1/models as vLLM does) says max_model_len, the
recipe its opening prompt's size, [run] max_new_tokens what a call may add."""

import subprocess

from .conftest import STEPMILL

MAX_MODEL_LEN = 32768  # what the simulated LLM says, as the tiny Qwen2 on vLLM does


def _config(tmp_path, base_url: str, prompt_tokens: int, max_new_tokens: int):
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "prompt": "What is 2 + 2?", "answer": "4"}\n')
    config = tmp_path / "rollout.toml"
    config.write_text(f"""
[proxy]
db = "{tmp_path / 'steps.db'}"
confdir = "{tmp_path / 'mitm'}"

[route]
base_url = "{base_url}"

[[agent]]
name = "big-prompt"
command = ["{{python}}", "-m", "stepmill.agents.tool_loop", "--model", "{{model}}"]
prompt_tokens = {prompt_tokens}

[[dataset]]
name = "fit"
path = "tasks.jsonl"

[run]
agent = "big-prompt"
dataset = "fit"
n = 1
model = "qwen-sim"
max_new_tokens = {max_new_tokens}
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
