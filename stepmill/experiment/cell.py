"""One cell and seed: its rollout file, ``stepmill train`` in a child (torch lives there, not here), and
its results written as JSON once it finished. The experiment's folder:

    results/<cell>/seed-<s>.json   a finished run: every version's numbers, of the run and its control
    runs/<cell>/seed-<s>/          its rollout file, tasks, store (stepmill.db), the trainer's log
    engine/                        the warm-started model and the vLLM that serves it (one for every cell)

A result file exists only for a run that finished (written to a temporary file, then renamed), so a
later invocation skips exactly what is done; an unfinished run's folder is cleared and run again.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from stepmill.experiment.catalog import CALL_TOKENS, DATASETS, agent_table, tasks_text
from stepmill.experiment.spec import Cell, Experiment
from stepmill.private_files import private_dir

RUN, CONTROL = "train", "train-control"  # the names `stepmill train` records the run and its control under


def result_path(folder: Path, cell: Cell, seed: int) -> Path:
    return folder / "results" / cell.name / f"seed-{seed}.json"


def read_result(path: Path) -> dict:
    return json.loads(path.read_text())


def finished(folder: Path, cell: Cell, seed: int) -> dict | None:
    path = result_path(folder, cell, seed)
    return read_result(path) if path.exists() else None


def shared_control(folder: Path, experiment: Experiment, cell: Cell, seed: int) -> dict | None:
    """A finished result of another cell with this cell's control (same dataset, runtime and seed: the
    control takes no step, so the method changes nothing of it), to be reused rather than run again."""
    for other in experiment.cells():
        if other != cell and other.control_key == cell.control_key:
            done = finished(folder, other, seed)
            if done and done.get("control") and not done.get("control_from"):
                return done
    return None


def rollout_toml(cell: Cell, seed: int, settings: dict, *, base_url: str, model: str, model_dir: Path) -> str:
    """The cell's rollout file: its runtime's [[agent]], its dataset's prompts and reward, the [train] table."""
    dataset = DATASETS[cell.dataset]
    return f"""# {cell.name}, seed {seed}: written by `stepmill experiment`.
[route]
base_url = "{base_url}"

[[agent]]
{agent_table(cell.runtime)}

[[dataset]]
name = "{cell.dataset}"
path = "tasks.jsonl"   # the first {settings['tasks']} prompts of stepmill/data/{dataset.file}

[run]
agent = "{cell.runtime}"
dataset = "{cell.dataset}"
n = {settings['n']}
concurrency = {settings['concurrency']}
timeout = {settings['timeout']}
max_new_tokens = {CALL_TOKENS}   # an agent CLI's {{max_new_tokens}}: what the other runtimes' calls may add
model = "{model}"

[[reward]]
name = "{cell.dataset}"
function = "{dataset.reward}"

[train]
model = "{model_dir}"
method = "{cell.method}"
layout = "{settings['layout']}"
iterations = {settings['iterations']}
lr = {settings['lr']!r}
seed = {seed}
control = true
"""


def machine() -> dict:
    """What ran it: the processor, its cores, the system."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "system": platform.platform()}


def _metrics(db: Path, run: str) -> list[dict]:
    from stepmill.store import Store

    store = Store(str(db), readonly=True)
    try:
        return [{k: v for k, v in row.items() if k != "run"} for row in store.train_metrics(run)]
    finally:
        store.close()


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(result, indent=1, sort_keys=True))
    partial.replace(path)


def run_cell(folder: Path, experiment: Experiment, cell: Cell, seed: int, server, *, command: str) -> dict:
    """Run one cell and seed on ``server`` (a running stepmill.demo.main.VLLMServer) and write its result.
    ``command`` is what reproduces it, kept in the result for the report."""
    from stepmill.demo.trainer_child import trainer_command

    work = folder / "runs" / cell.name / f"seed-{seed}"
    shutil.rmtree(work, ignore_errors=True)  # an unfinished attempt's store would refuse the run's name
    private_dir(work)
    (work / "tasks.jsonl").write_text(tasks_text(cell.dataset, experiment.settings["tasks"]))
    rollout = work / "rollout.toml"
    rollout.write_text(rollout_toml(cell, seed, experiment.settings, base_url=server.url, model=server.name,
                                    model_dir=server.model_dir))
    control = shared_control(folder, experiment, cell, seed)
    args, env = trainer_command(str(rollout), "--db", str(work / "stepmill.db"), *(["--no-control"] if control else []))
    started, began = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(work / "train.log", "wb") as log:
        done = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    if done.returncode != 0:
        tail = (work / "train.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cell.name} seed {seed}: stepmill train failed (exit {done.returncode}); "
                           f"{work / 'train.log'} ends:\n{tail}")
    result = {"experiment": experiment.name, "cell": cell.name, "factors": cell.__dict__, "seed": seed,
              "settings": experiment.settings, "started": began, "wall_s": time.monotonic() - started,
              "machine": machine(), "command": command,
              "run": _metrics(work / "stepmill.db", RUN),
              "control": control["control"] if control else _metrics(work / "stepmill.db", CONTROL),
              "control_from": control["cell"] if control else None}
    _write(result_path(folder, cell, seed), result)
    return result


def load_results(folder: Path) -> dict[str, list[dict]]:
    """Every finished result in the folder, by cell name, in seed order."""
    results: dict[str, list[dict]] = {}
    for path in sorted((folder / "results").glob("*/seed-*.json")):
        result = read_result(path)
        results.setdefault(result["cell"], []).append(result)
    for rows in results.values():
        rows.sort(key=lambda r: r["seed"])
    return results
