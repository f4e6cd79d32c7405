"""``stepmill experiment EXPERIMENTS.toml``: run what is not yet done of the matrix, then write the report."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import click

from stepmill.errors import ConfigError
from stepmill.experiment.catalog import CALL_TOKENS
from stepmill.experiment.cell import finished, run_cell
from stepmill.experiment.report import write_report
from stepmill.experiment.spec import Cell, Experiment, load
from stepmill.experiment.stats import seed_line


def _chosen(experiment: Experiment, cells: tuple[str, ...], seeds: tuple[int, ...]) -> list[tuple[Cell, int]]:
    """The (cell, seed) pairs asked for, cell by cell (the default first), each cell's seeds in order."""
    known = {cell.name: cell for cell in experiment.cells()}
    unknown = [name for name in cells if name not in known]
    if unknown:
        raise ConfigError(f"no cell named {', '.join(unknown)}; the cells: {', '.join(known)}")
    wrong = [s for s in seeds if s not in experiment.seeds]
    if wrong:
        raise ConfigError(f"seed(s) {wrong} are not the file's seeds {experiment.seeds}")
    return [(known[name], seed) for name in (cells or known) for seed in (seeds or experiment.seeds)]


def start_engine(folder: Path):
    """The demo's engine: the warm-started tiny Qwen2 on the real vLLM in dev mode (in-place reloads)."""
    from stepmill.demo.main import ENGINE_INSTALL, start_vllm, vllm_python

    if vllm_python() is None:
        raise ConfigError(f"experiments run on the real vLLM: run {ENGINE_INSTALL} from the project first")
    click.echo(f"starting vLLM on the warm-started model in {folder / 'engine'} (minutes)", err=True)
    return start_vllm(folder / "engine", warm_start=True, dev_mode=True, worker_extension=True,
                      max_new_tokens=CALL_TOKENS, timeout=900)


def _reproduce(path: str, folder: str | None, cell: Cell, seed: int) -> str:
    """The command that runs this cell and seed again, with the file and folder as they were given."""
    where = f" --folder {shlex.quote(folder)}" if folder else ""
    return f"stepmill experiment {shlex.quote(path)}{where} --cell {cell.name} --seed {seed} --again"


@click.command()
@click.argument("experiments_path", metavar="EXPERIMENTS", type=click.Path(exists=True, dir_okay=False))
@click.option("--folder", type=click.Path(file_okay=False), default=None,
              help="Where results, runs and the report go (default: ./<the experiment's name>).")
@click.option("--cell", "cells", multiple=True, help="Only this cell (repeat for more; --list names them).")
@click.option("--seed", "seeds", type=int, multiple=True, help="Only this seed (repeat for more).")
@click.option("--again", is_flag=True, help="Run the chosen cells and seeds even if they have finished.")
@click.option("--stop-after", type=click.FloatRange(min=0), default=None, metavar="MINUTES",
              help="Start no new run after this many minutes (a piece of the matrix; the rest is kept for later).")
@click.option("--list", "list_only", is_flag=True, help="List the cells and seeds, done or not; run nothing.")
@click.option("--report", "report_only", is_flag=True, help="Only write the report from what has finished.")
def experiment(experiments_path, folder, cells, seeds, again, stop_after, list_only, report_only):
    """Run a matrix of training runs, each beside its paired control, on the real vLLM: the default cell
    and the factors varied around it (dataset, method, runtime), over the seeds. Finished runs are kept
    and skipped; the report (report.md, plots/) is rewritten after each run."""
    spec = load(experiments_path)
    given, folder = folder, Path(folder or spec.name).resolve()
    order = [cell.name for cell in spec.cells()]
    chosen = _chosen(spec, cells, seeds)
    if list_only:
        for cell, seed in chosen:
            done = finished(folder, cell, seed)
            click.echo(f"{cell.name} seed {seed}: " + (f"done ({done['wall_s']:.0f} s)" if done else "to run"))
        return
    done = sum(finished(folder, c, s) is not None for c, s in chosen)
    todo = [] if report_only else [(c, s) for c, s in chosen if again or not finished(folder, c, s)]
    click.echo(f"{spec.name}: {done} of {len(chosen)} runs finished, {len(todo)} to run ({folder})", err=True)
    if todo:
        _run(spec, folder, todo, stop_after, lambda c, s: _reproduce(experiments_path, given, c, s))
    report = write_report(folder, order=order, title=spec.name)
    click.echo(str(report))


def _run(spec: Experiment, folder: Path, todo: list[tuple[Cell, int]], stop_after: float | None, reproduce) -> None:
    from stepmill.private_files import private_dir

    private_dir(folder)
    started = time.monotonic()
    server = start_engine(folder)
    try:
        for cell, seed in todo:
            if stop_after is not None and time.monotonic() - started > stop_after * 60:
                click.echo(f"stopping after {stop_after:g} minutes: the rest runs next time", err=True)
                return
            click.echo(f"{cell.name} seed {seed}: running", err=True)
            result = run_cell(folder, spec, cell, seed, server, command=reproduce(cell, seed))
            click.echo(f"{cell.name} seed {seed}: {seed_line(result)}", err=True)
            write_report(folder, order=[c.name for c in spec.cells()], title=spec.name)
    finally:
        server.stop()
