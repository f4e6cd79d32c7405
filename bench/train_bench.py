"""One training step (forward + backward of the GRPO loss) per group on the three layouts.

Groups like the demo's: ``--groups`` groups of ``--n`` multi-turn rollouts that share a long system
prompt, pairs of rollouts share a task, each turn's prompt continues the last token-exactly (the
response, a tool observation, template tokens). They are written to a SQLite store and read back
through the layouts: padded steps (``group_batch``), trajectory rows (``trajectory_rows``) and the
packed prefix tree (``pack_batch`` of the step batch). The model is a tiny random Qwen2.

Tree attention: FlexAttention where torch can train with it (CUDA); on the CPU, where torch has no
FlexAttention backward, the tree trains with a dense 4-D mask (SDPA), and ``--flex`` adds a
forward-only FlexAttention timing (float32, compiled once beforehand).

Reported per layout: tokens the model runs over (padded cells / packed tokens), seconds per step
(median of ``--repeat``; wall and CPU time, the latter steadier on a shared machine), and peak
memory (CUDA: allocated; CPU: the step's rise in peak RSS, each layout in a process of its own).

    .venv/bin/python -m bench.train_bench                   # about a minute on two cores
    .venv/bin/python -m bench.train_bench --groups 2 --n 16 --system 1024 --flex
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _with_torch() -> None:
    """torch from the engine venvs, after the project's packages (as .ci/pytest-torch does)."""
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    for venv in (".engines/vllm", ".engines/train"):
        python = ROOT / venv / "bin" / "python"
        if python.exists():
            site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            sys.path.append(site)


def build_store(path: Path, args) -> list[str]:
    """The groups as captured steps with ids and logprobs, trajectory rewards set."""
    import numpy as np

    from stepmill.store import StepRecord, Store

    rng = np.random.default_rng(0)
    store = Store(path)
    system = rng.integers(3, args.vocab, args.system).tolist()
    groups = []
    for g in range(args.groups):
        group = f"bench-g{g}"
        groups.append(group)
        tasks = [rng.integers(3, args.vocab, args.task).tolist() for _ in range((args.n + 1) // 2)]
        for i in range(args.n):
            trajectory = f"{group}-t{i}"
            messages = [{"role": "system", "content": "system"}, {"role": "user", "content": f"task {i // 2}"}]
            prompt = [1] + system + [2] + tasks[i // 2] + [2]
            for turn in range(args.turns):
                response = rng.integers(3, args.vocab, int(rng.integers(args.response // 2, args.response + 1))).tolist()
                logprobs = (-rng.exponential(0.5, len(response))).tolist()
                completion = {"role": "assistant", "content": f"{trajectory} {turn}"}
                store.record_step(StepRecord(api="openai.chat", messages=messages, completion=completion,
                                             trajectory_id=trajectory, group_id=group, prompt_ids=prompt,
                                             response_ids=response, logprobs=logprobs, token_provenance="exact"))
                observation = rng.integers(3, args.vocab, int(rng.integers(args.observation // 2, args.observation + 1)))
                messages = messages + [completion, {"role": "tool", "content": f"observation {turn}"}]
                prompt = prompt + response + [2] + observation.tolist() + [2]
            store.add_reward(trajectory, float(rng.integers(0, 2)))
    store.close()
    return groups


def batches(db: Path, groups: list[str], layout: str):
    from stepmill.store import Store
    from stepmill.train.forward import pack_batch
    from stepmill.trainer_bridge.layouts import group_batch, trajectory_batch, trajectory_rows

    store = Store(db)
    try:
        for group in groups:
            if layout == "rows":
                rows, report = trajectory_rows(store, group_id=group)
                yield "rows", trajectory_batch(rows, report)
            elif layout == "steps":
                yield "steps", group_batch(store, group)
            else:
                yield "tree", pack_batch(group_batch(store, group))
    finally:
        store.close()


def model_for(args, attention: str, dtype):
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1 << 15)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return transformers.Qwen2ForCausalLM._from_config(config, attn_implementation=attention).to(device, dtype)


def measure(args) -> dict:
    """One layout, in this process: tokens, seconds per step, peak memory."""
    import torch

    from stepmill.train.forward import loss
    from stepmill.train.methods import method

    cuda = torch.cuda.is_available()
    flex_forward = args.measure == "tree-flex-forward"
    layout = "tree" if args.measure.startswith("tree") else args.measure
    attention = "flex_attention" if (cuda and layout == "tree") or flex_forward else "sdpa"
    model = model_for(args, attention, torch.float32)
    rl = method("grpo")
    loaded = list(batches(Path(args.db), args.group_ids, layout))
    cells = sum(int(b.tensors["input_ids"].size) for _, b in loaded)
    real = sum(int(b.tensors["input_ids"].size if kind == "tree" else b.tensors["attention_mask"].sum())
               for kind, b in loaded)
    trained = sum(int((b.tensors["seq_loss_mask"] if kind == "tree" else b.tensors["response_mask"]).sum())
                  for kind, b in loaded)

    def step():
        model.zero_grad(set_to_none=True)
        for kind, batch in loaded:
            if flex_forward:
                with torch.no_grad():
                    loss(model, batch, kind, rl)
            else:
                value, _ = loss(model, batch, kind, rl)
                value.backward()
        if cuda:
            torch.cuda.synchronize()

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the model and batches loaded
    step()  # warm-up (FlexAttention compiles here)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, cpu = [], []
    for _ in range(args.repeat):
        started, started_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    peak = (torch.cuda.max_memory_allocated() if cuda
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024)
    return {"layout": args.measure, "attention": attention, "tokens": cells, "real": real, "trained": trained,
            "seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu), "peak_bytes": peak,
            "device": "cuda" if cuda else "cpu",
            "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=8, help="rollouts per group")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    parser.add_argument("--task", type=int, default=64, help="tokens of a task (pairs of rollouts share one)")
    parser.add_argument("--response", type=int, default=96, help="most tokens a turn samples (at least half)")
    parser.add_argument("--observation", type=int, default=48, help="most tokens of a tool observation")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flex", action="store_true", help="on the CPU, also time FlexAttention forward-only")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--group-ids", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _with_torch()
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    import torch

    with tempfile.TemporaryDirectory(prefix="stepmill-train-bench-") as folder:
        db = Path(folder) / "steps.db"
        groups = build_store(db, args)
        layouts = ["steps", "rows", "tree"]
        if args.flex and not torch.cuda.is_available():
            layouts.append("tree-flex-forward")
        passed = [a for a in (argv if argv is not None else sys.argv[1:])]
        results = []
        for layout in layouts:  # each in a process of its own: its own peak memory
            done = subprocess.run([sys.executable, "-m", "bench.train_bench", *passed, "--measure", layout,
                                   "--db", str(db), "--group-ids", *groups],
                                  capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
                print(f"{layout} failed: {' / '.join(errors[-3:]) or done.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = results[0]
    print(f"\nGRPO loss forward + backward, {args.groups} groups × {args.n} rollouts × {args.turns} turns, "
          f"system prompt {args.system} tokens; tiny Qwen2 (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}), float32 on {base['device']} ({base['threads']} threads); trained tokens "
          f"{base['trained']} in every layout")
    print("| layout | attention | tokens run (with padding) | non-padding tokens | ×steps' tokens | s/step | "
          "×steps' time | CPU s/step | peak memory MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        label = r["layout"] + (" (forward only)" if r["layout"].endswith("forward") else "")
        print(f"| {label} | {r['attention']} | {r['tokens']} | {r['real']} | {r['real'] / base['real']:.3f} | "
              f"{r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f} | {r['cpu_seconds']:.3f} | "
              f"{r['peak_bytes'] / 2**20:.0f} |")
    print(f"\nreproduce: .venv/bin/python -m bench.train_bench {shlex.join(passed)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
