"""`stepmill train` beside TRL's GRPOTrainer: the same task, model, rollouts per prompt, learning rate and
sampling seeds, in one run, against one real vLLM (dev mode, stepmill's worker extension).

Both trainers roll out through stepmill (TRL through ``stepmill.train.trl_adapter``'s ``rollout_func``)
and serve each version on the engine, verified by the probe; each runs in a process of its own, so that
its peak memory is its own. Reported per trainer: versions, seconds per version (wall, the whole run
over its versions: rollouts, steps, syncs; stepmill's also rolls out one more round, to measure its last
version), tokens per second (prompt and response tokens of every rollout it trained on, over the same
wall time), peak RSS of the trainer's process, and the mean reward of the first and the last round it
trained on.

The task: four prompts, ``--n`` replies each, one reply per run (the white-box ``one_reply``) of at most
16 tokens; the reward is the share of ASCII letters in the reply (a few steps move it on the random
Qwen2 the engine serves). CPU, float32.

    make bench-trl                                              # about five minutes on two cores
    .ci/python-torch -m bench.trl_compare --iterations 5 --n 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from bench.train_bench import _with_torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["Name a sea animal.", "Say hello to a friend.", "Describe the sky today.", "List three fruits."]
MAX_TOKENS = 16
SEED = 0


# -- what the runs use: the agent and the reward (importable by the runner and the agent's process) ----

def one_reply(task, session):
    """One reply to the task in Qwen's chat format, temperature 1, with a seed from the run's round, task
    and sample (never the trainer's name): both trainers' runs of one round draw alike."""
    ids = session.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    found = re.search(r"-r(\d+)-(.+)$", os.environ["STEPMILL_TRAJECTORY"])
    seed = zlib.crc32(f"{found.group(1)}:{found.group(2)}".encode()) & 0x7FFFFFFF
    return session.generate(ids, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": task["prompt"]}],
                             temperature=1.0, seed=seed).text


def ascii_letters(trajectory: dict) -> float:
    """The share of the reply's characters that are ASCII letters (0 for an empty reply)."""
    text = (trajectory.get("completion") or {}).get("content") or ""
    text = text if isinstance(text, str) else json.dumps(text)
    return sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0


def write_config(folder: Path, url: str, name: str, n: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tasks.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "prompt": p}) + "\n"
                                                for i, p in enumerate(TASKS)))
    config = folder / "rollout.toml"
    config.write_text(f"""[proxy]
confdir = "{folder / 'mitm'}"

[route]
base_url = "{url}"

[[agent]]
name = "one-reply"
entry = "bench.trl_compare:one_reply"
env = {{ PYTHONPATH = "{ROOT}" }}

[[dataset]]
name = "words"
path = "tasks.jsonl"

[run]
agent = "one-reply"
dataset = "words"
n = {n}
concurrency = 4
timeout = 120
model = "{name}"

[[reward]]
name = "ascii"
function = "bench.trl_compare:ascii_letters"
""")
    return config


# -- one trainer, in its own process ------------------------------------------------------------------

def one_trainer(args) -> dict:
    """Train with ``args.trainer`` for ``args.iterations`` versions; what it measured."""
    _with_torch()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from stepmill.runner.config import load
    from stepmill.store import Store
    from stepmill.train.config import TrainConfig

    folder = Path(args.folder)
    config = load(write_config(folder, args.url, args.name, args.n))
    train = TrainConfig(model=args.model_dir, method="grpo", layout="steps", iterations=args.iterations, lr=args.lr,
                        clip_low=0.2, clip_high=0.28, kl=0.0, control=False, seed=SEED).check()
    db = str(folder / f"{args.trainer}.db")
    started = time.monotonic()
    if args.trainer == "stepmill":
        from stepmill.train.loop import train_loop

        reports = train_loop(config, train, db=db, progress=False, name=args.trainer).run
        rewards = [r.metrics.get("reward") for r in reports][:args.iterations]  # the rounds it trained on
    else:
        from stepmill.train.trl_adapter import trl_train

        rounds = trl_train(config, train, db=db, name=args.trainer, use_cpu=True).rounds
        rewards = [r.mean_reward for r in rounds]
    wall = time.monotonic() - started
    store = Store(db, readonly=True)
    trained = tuple(f"{args.trainer}-r{k}-" for k in range(args.iterations))  # not stepmill's last, measured round
    tokens = sum(len(s["prompt_ids"] or []) + len(s["response_ids"] or []) for s in store.iter_steps()
                 if s["trajectory_id"].startswith(trained))
    store.close()
    return {"trainer": args.trainer, "versions": args.iterations, "wall_s": wall, "tokens": tokens,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rewards": rewards}


# -- the comparison --------------------------------------------------------------------------------------

def table(results: list[dict]) -> str:
    lines = ["| trainer | versions | s / version | tokens / s | peak RSS (MiB) | reward, first round | reward, last round |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        first, last = r["rewards"][0], r["rewards"][-1]
        lines.append(f"| {r['trainer']} | {r['versions']} | {r['wall_s'] / r['versions']:.1f} | "
                     f"{r['tokens'] / r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {first:.3f} | {last:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3, help="versions each trainer trains")
    parser.add_argument("--n", type=int, default=4, help="rollouts per prompt (the group)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--trainer", choices=("stepmill", "trl"), help=argparse.SUPPRESS)  # one trainer's process
    for hidden in ("--url", "--name", "--model-dir", "--folder"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        print(json.dumps(one_trainer(args)))
        return
    from stepmill.demo.main import start_vllm
    from stepmill.qwen_vocab import default_folder

    folder = Path(tempfile.mkdtemp(prefix="stepmill-trl-compare-"))
    server = start_vllm(folder / "engine", tokenizer=default_folder(), timeout=900, tied=True, dev_mode=True,
                        worker_extension=True)
    results = []
    try:
        for trainer in ("stepmill", "trl"):  # one after the other: each has the machine to itself
            command = [sys.executable, "-m", "bench.trl_compare", "--trainer", trainer, "--iterations",
                       str(args.iterations), "--n", str(args.n), "--lr", str(args.lr), "--url", server.url,
                       "--name", server.name, "--model-dir", str(server.model_dir), "--folder", str(folder / trainer)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"{trainer} failed:\n{done.stderr[-4000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        server.stop()
    print(table(results))
    print(f"\nreproduce: .ci/python-torch -m bench.trl_compare --iterations {args.iterations} --n {args.n} "
          f"--lr {args.lr}   ({shlex.quote(os.uname().nodename)}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
