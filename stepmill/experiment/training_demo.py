"""``stepmill demo --engine vllm --train``: the loop closed, offline, on the real vLLM — the experiments'
default cell, run by the experiments' own runner.

A tiny Qwen2 (the real vocabulary, random weights after a warm start of under a minute on English word lists:
stepmill.demo.warm_start) is served by vLLM in dev mode with stepmill's worker extension; the black-box
agent answers the bundled ``animals16`` prompts through ``stepmill proxy``; ``topic_words`` scores each
reply (different animals named: padding and repetition cannot win it); ``stepmill train`` runs the paired
control, then the run: each version rolled out, its groups consumed together, one GRPO step, the weights
served in place and checked by the probe, the next calls stamped with the new version.

What runs is the default cell of the shipped ``experiments.example.toml`` (``stepmill.experiment``), one
seed at a time (``--seed``, repeatable): each seed's reward per version beside its control, its margin, and
over two seeds or more the margin's 95% interval, which says whether it excludes zero. The same cell and
seeds through ``stepmill experiment`` give the same runs: docs/experiments.md has them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from importlib import resources
from pathlib import Path

from stepmill.demo.main import info, keep_serving, say, start_ui
from stepmill.experiment.cell import run_cell
from stepmill.experiment.command import start_engine
from stepmill.experiment.report import write_report
from stepmill.experiment.spec import load
from stepmill.experiment.stats import cell_numbers, seed_line, seed_table
from stepmill.private_files import private_dir

EXPERIMENTS = "experiments.example.toml"  # in stepmill/data: the demo runs its default cell


def default_cell(**settings):
    """The shipped experiments' default cell, with the run's size (tasks, n, iterations, concurrency) as given."""
    with resources.as_file(resources.files("stepmill") / "data" / EXPERIMENTS) as path:
        spec = load(path)
    spec.settings.update({k: v for k, v in settings.items() if v is not None})
    return spec, spec.default


def margin_verdict(results: list[dict]) -> str:
    """The margin over the seeds run, and whether its 95% interval excludes zero (two seeds or more)."""
    mean, half = cell_numbers(results)["margin"]
    if mean is None:
        return "no margin: a run or its control has no reward"
    if half is None:
        return f"margin over the control {mean:+.3f} (one seed: run more seeds for an interval)"
    low, high = mean - half, mean + half
    verdict = "excludes zero: learning" if low > 0 or high < 0 else "reaches zero: not distinguishable from noise"
    return f"margin over the control {mean:+.3f} ± {half:.3f} (95%, {len(results)} seeds): [{low:+.3f}, {high:+.3f}] {verdict}"


def _clear(folder: Path) -> None:
    for old in ("results", "runs", "plots", "report.md", "summary.json"):
        path = folder / old
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def run_training_demo(folder: Path, *, seeds: tuple[int, ...] = (0,), tasks: int | None = None, n: int | None = None,
                      iterations: int | None = None, concurrency: int | None = None, ui: bool = True, wait: bool = True,
                      ui_port: int | None = None) -> dict:
    """The default cell over ``seeds``; the run's size the shipped file's where not given."""
    started = time.time()
    folder = folder.resolve()
    private_dir(folder)
    _clear(folder)  # engine/ is kept: its warm-started model is written once and reused
    spec, cell = default_cell(tasks=tasks, n=n, iterations=iterations, concurrency=concurrency)
    children: list[subprocess.Popen] = []
    say("setup", f"everything goes to {folder}")
    info("engine: the REAL vLLM in dev mode (in-place weight reloads) on a tiny Qwen2 it writes here: random "
         "weights, then a short warm start on English word lists (the base; the control starts from it too)")
    server = start_engine(folder)
    summary: dict = {"folder": str(folder), "engine": server.url, "cell": cell.name, "seeds": list(seeds)}
    results = []
    try:
        info(f"vLLM at {server.url} ({server.model_dir}); its log: {server.log}")
        say("train", f"the experiments' default cell {cell.name}: for each seed the paired control, then the run: "
                     f"{spec.settings['iterations']} versions, {spec.settings['tasks']} prompts × {spec.settings['n']} "
                     f"rollouts each")
        info("each version: roll out → claim its groups together → one GRPO step → ack → weights served in place "
             "(probe checked) → the next calls stamped with the new version")
        for seed in seeds:
            again = f"stepmill demo --engine vllm --train --seed {seed} --dir {folder}"
            result = run_cell(folder, spec, cell, seed, server, command=again)
            results.append(result)
            print(f"seed {seed}:\n{seed_table(result)}\n{seed_line(result)}", flush=True)
        verdict = margin_verdict(results)
        say("margin", verdict)
        summary.update(margin=verdict, report=str(write_report(folder, order=[cell.name], title="stepmill demo --train")))
        info(f"the report: {summary['report']}; each seed's store and trainer log: {folder / 'runs' / cell.name}")
        if ui:
            say("review", "the UI's training page: reward per version beside the control")
            db = folder / "runs" / cell.name / f"seed-{seeds[-1]}" / "stepmill.db"
            home, sign_in = start_ui(folder, db, ui_port, children)
            if sign_in:
                info(f"sign in first: {sign_in}")
            info(f"training (seed {seeds[-1]}): {home}/-/stepmill/training")
            summary["ui"] = f"{home}/-/stepmill/training"
        say("done", f"in {time.time() - started:.0f} s")
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        if ui and wait:
            keep_serving(children[-1])
        return summary
    finally:
        server.stop()
        for child in children:
            child.terminate()
            child.wait(10)
