"""``stepmill demo --engine vllm --train``: the loop closed, offline, on the real vLLM.

A tiny Qwen2 (the real vocabulary, random weights after a warm start of under a minute on English word lists:
stepmill.demo.warm_start) is served by vLLM in dev mode with stepmill's worker extension; the black-box
agent answers the bundled ``animals16`` prompts through ``stepmill proxy``; ``topic_words`` scores each
reply (different animals named: padding and repetition cannot win it);
``stepmill train`` runs the paired control, then the run: each version rolled out, its groups consumed
together, one GRPO step, the weights served in place and checked by the probe, the next calls stamped
with the new version. Reward per version of both is printed and shown on the UI's training page.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from importlib import resources
from pathlib import Path

from stepmill.demo.main import ENGINE_INSTALL, info, keep_serving, say, start_ui, start_vllm, vllm_python
from stepmill.demo.trainer_child import trainer_command
from stepmill.errors import ConfigError
from stepmill.private_files import private_dir


def training_config(base_url: str, model: str, model_dir: Path, *, tasks: int, n: int, iterations: int,
                    concurrency: int) -> str:
    return f"""# The closed loop: written by `stepmill demo --engine vllm --train`.
[route]
base_url = "{base_url}"

[[agent]]
name = "tool-loop"
command = ["{{python}}", "-m", "stepmill.agents.tool_loop", "--model", "{{model}}"]
env = {{ OPENAI_API_KEY = "sk-local" }}

[[dataset]]
name = "animals"
path = "tasks.jsonl"   # {tasks} of the bundled animals16 prompts

[run]
agent = "tool-loop"
dataset = "animals"
n = {n}
concurrency = {concurrency}
timeout = 120
model = "{model}"

[[reward]]
name = "animals"
function = "stepmill.rewards.functions:topic_words"

[train]
model = "{model_dir}"
method = "grpo"
iterations = {iterations}
lr = 5e-3
control = true
"""


def run_training_demo(folder: Path, *, tasks: int = 4, n: int = 4, iterations: int = 10, concurrency: int = 4,
                      ui: bool = True, wait: bool = True, ui_port: int | None = None) -> dict:
    started = time.time()
    folder = folder.resolve()
    private_dir(folder)
    for old in ("stepmill.db", "stepmill.db-wal", "stepmill.db-shm", "engine"):
        path = folder / old
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if vllm_python() is None:
        raise ConfigError(f"the training demo runs on the real vLLM: run {ENGINE_INSTALL} from the project first "
                          "(it makes .engines/vllm, about 6 GB)")
    command, env = trainer_command(str(folder / "rollout.toml"), "--db", str(folder / "stepmill.db"))
    children: list[subprocess.Popen] = []
    say("setup", f"everything goes to {folder}")
    info("engine: the REAL vLLM in dev mode (in-place weight reloads) on a tiny Qwen2 it writes here: random "
         "weights, then a short warm start on English word lists (the base; the control starts from it too)")
    server = start_vllm(folder / "engine", warm_start=True, dev_mode=True, worker_extension=True, max_new_tokens=48)
    summary: dict = {"folder": str(folder), "engine": server.url}
    try:
        info(f"vLLM at {server.url} ({server.model_dir}); its log: {server.log}")
        lines = (resources.files("stepmill") / "data" / "animals16.jsonl").read_text().splitlines(True)[:tasks]
        (folder / "tasks.jsonl").write_text("".join(lines))
        config = folder / "rollout.toml"
        config.write_text(training_config(server.url, server.name, server.model_dir, tasks=len(lines), n=n,
                                          iterations=iterations, concurrency=concurrency))
        say("train", f"the paired control, then the run: {iterations} versions, {len(lines)} prompts × {n} rollouts each")
        info("each version: roll out → claim its groups together → one GRPO step → ack → weights served in place "
             "(probe checked) → the next calls stamped with the new version")
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"stepmill train failed (exit {done.returncode}); its output is above")
        print(done.stdout, flush=True)
        summary["table"] = done.stdout
        if ui:
            say("review", "the UI's training page: reward per version beside the control")
            home, sign_in = start_ui(folder, folder / "stepmill.db", ui_port, children)
            if sign_in:
                info(f"sign in first: {sign_in}")
            info(f"training: {home}/-/stepmill/training")
            summary["ui"] = f"{home}/-/stepmill/training"
        say("done", f"in {time.time() - started:.0f} s; the configuration that ran: {config}")
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        if ui and wait:
            keep_serving(children[-1])
        return summary
    finally:
        server.stop()
        for child in children:
            child.terminate()
            child.wait(10)
