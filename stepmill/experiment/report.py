"""The report of an experiment's folder: one Markdown table row per cell (its numbers over its seeds),
the command that reproduces each cell, and a PNG of each cell's reward curves (matplotlib: the
``experiments`` extra; without it the table is written and the plots are said to be missing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from stepmill.experiment.cell import load_results
from stepmill.experiment.stats import cell_numbers

COLUMNS = ["cell", "seeds", "reward v0", "last 3 versions", "control (last 3)", "margin", "s / version",
           "tokens / s trained", "sync s", "rollout gap", "cost s"]


def _number(value, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _interval(pair: tuple, sign: bool = False) -> str:
    mean, half = pair
    if mean is None:
        return "–"
    return _number(mean, sign=sign) + ("" if half is None else f" ± {half:.3f}")


def table_row(name: str, numbers: dict) -> str:
    cells = [f"`{name}`", str(numbers["seeds"]), _interval(numbers["reward_v0"]), _interval(numbers["last3"]),
             _interval(numbers["control_last3"]), _interval(numbers["margin"], sign=True),
             _number(numbers["s_per_version"], 1), _number(numbers["tokens_per_s"], 0), _number(numbers["sync_s"], 2),
             _number(numbers["rollout_gap"], 6), f"{numbers['wall_s']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def table(results: dict[str, list[dict]], order: list[str] | None = None) -> str:
    names = [n for n in (order or []) if n in results] + sorted(n for n in results if n not in (order or []))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += [table_row(name, cell_numbers(results[name])) for name in names]
    return "\n".join(lines)


def plot(name: str, results: list[dict], path: Path) -> Path:
    """Reward per version: each seed's run (thin) and their mean (thick) beside the control's mean (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.4), dpi=100)
    for label, key, style in (("run", "run", "-"), ("control", "control", "--")):
        curves = [{row["version"]: row.get("reward") for row in r[key] or []} for r in results]
        versions = sorted({v for c in curves for v in c})
        if label == "run":
            for curve in curves:
                axes.plot(list(curve), list(curve.values()), style, color="tab:blue", alpha=0.3, linewidth=1)
        means = [sum(c[v] for c in curves if c.get(v) is not None) / max(1, sum(c.get(v) is not None for c in curves))
                 for v in versions]
        axes.plot(versions, means, style, color="tab:blue" if label == "run" else "tab:gray", linewidth=2,
                  label=f"{label} (mean of {len(results)} seed{'s' * (len(results) != 1)})")
    axes.set_xlabel("policy version")
    axes.set_ylabel("reward")
    axes.set_title(name, fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def write_report(folder: Path, *, order: list[str] | None = None, title: str = "") -> Path:
    """``report.md`` (and ``plots/<cell>.png``) in the experiment's folder, from what has finished."""
    results = load_results(folder)
    lines = [f"# {title or folder.name}", "", table(results, order), ""]
    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:
        lines += ["Plots not drawn: matplotlib is not installed (pip install 'stepmill[experiments]').", ""]
    for name in [n for n in (order or []) if n in results] + sorted(n for n in results if n not in (order or [])):
        lines += [f"## `{name}`", ""]
        if plots:
            plot(name, results[name], folder / "plots" / f"{name}.png")
            lines += [f"![{name}](plots/{name}.png)", ""]
        for result in results[name]:
            shared = f", its control that of `{result['control_from']}`" if result.get("control_from") else ""
            lines.append(f"- seed {result['seed']}: `{result['command']}` ({result['wall_s']:.0f} s on "
                         f"{result['machine']['cores']} cores, {result['started']}{shared})")
        lines.append("")
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path
