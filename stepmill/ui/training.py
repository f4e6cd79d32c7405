"""What the training page shows: a run's numbers per policy version (``train_metrics``, recorded by
``stepmill train``) beside its paired control's, the reward chart drawn as an inline SVG here (no
script, nothing fetched: clusters are often offline), and the margin the run is judged by.

A run ``NAME``'s control is the run ``NAME-control`` (same tasks and seeds, no optimizer step).
"""

from __future__ import annotations

import math

from stepmill.errors import NotFound
from stepmill.store import Store

# stepmill train's default ``[train] tolerance``: the largest engine-vs-trainer logprob gap a sync
# may leave. A version that recorded a ``tolerance`` of its own is held to that one.
TOLERANCE = 1e-4
CONTROL = "-control"
LAST = 3  # the run is judged by its last versions' mean reward against its control's (as `stepmill train` prints)

# The per-version table: (key, heading, format). Control's reward sits beside the run's.
COLUMNS = (
    ("reward", "reward", "reward"),
    ("control_reward", "control reward", "reward"),
    ("val_reward", "held-out reward", "reward"),
    ("logprob_gap", "logprob gap", "gap"),
    ("rollout_gap", "rollout gap", "gap"),
    ("staleness_mean", "staleness mean", "number"),
    ("staleness_max", "staleness max", "count"),
    ("distinct_2", "distinct-2", "share"),
    ("repetition", "repetition", "share"),
    ("sync_s", "sync s", "seconds"),
)
# The optimizer and the clock, per version (a second, smaller table).
DETAILS = (
    ("loss", "loss", "number"),
    ("clip_fraction", "clip fraction", "share"),
    ("grad_norm", "grad norm", "number"),
    ("unique_responses", "unique responses", "share"),
    ("flat_groups", "flat groups", "share"),
    ("response_tokens", "response tokens", "number"),
    ("rollout_s", "rollout s", "seconds"),
    ("train_s", "train s", "seconds"),
    ("engine_paused_s", "engine paused s", "seconds"),
)


def fmt(value, kind: str = "number") -> str:
    """A number as the page shows it; ``—`` for one not measured."""
    if value is None:
        return "—"
    if kind == "gap":
        return f"{value:.2e}"
    if kind == "count":
        return f"{value:.0f}"
    if kind in ("reward", "share"):
        return f"{value:.3f}"
    if kind == "seconds":
        return f"{value:.2f}"
    return f"{value:.4g}"


def run_choices(runs: list[str]) -> list[str]:
    """The runs a page is about: every run but a control whose run is recorded too."""
    names = set(runs)
    return [r for r in runs if not (r.endswith(CONTROL) and r[: -len(CONTROL)] in names)]


def last_mean(rows: list[dict], k: int = LAST) -> float | None:
    """The mean reward of the last ``k`` versions (those without a reward left out)."""
    values = [r["reward"] for r in rows[-k:] if r.get("reward") is not None]
    return sum(values) / len(values) if values else None


def training(store: Store, run: str | None = None, tolerance: float | None = None) -> dict:
    """The page's data for ``run`` (default: the first with a control) and its control; ``runs`` empty when
    nothing was recorded. ``tolerance`` overrides the default for versions that recorded none."""
    runs = store.train_runs()
    choices = run_choices(runs)
    if not runs:
        return {"runs": [], "run": None, "control": None, "rows": [], "columns": [], "details": [],
                "chart": None, "gap_chart": None, "margin": None, "tolerance": tolerance or TOLERANCE}
    run = run or next((r for r in choices if r + CONTROL in runs), choices[0])  # one paired, when there is
    if run not in runs:
        raise NotFound(f"training run {run!r}")
    control = run + CONTROL if run + CONTROL in runs else None
    mine = store.train_metrics(run)
    theirs = store.train_metrics(control) if control else []
    by_version = {r["version"]: r for r in theirs}
    default = TOLERANCE if tolerance is None else tolerance
    rows = []
    for version in sorted({r["version"] for r in mine} | set(by_version)):
        row = next((r for r in mine if r["version"] == version), {"version": version})
        limit = row.get("tolerance", default)
        gap = row.get("logprob_gap")
        values = {**dict.fromkeys(key for key, _, _ in COLUMNS + DETAILS), **row,
                  "control_reward": by_version.get(version, {}).get("reward")}
        rows.append({"version": version, "values": values, "tolerance": limit,
                     "gap_over": gap is not None and gap > limit})
    run_mean, control_mean = last_mean(mine), last_mean(theirs)
    margin = {"k": LAST, "run": run_mean, "control": control_mean,
              "margin": None if run_mean is None or control_mean is None else run_mean - control_mean}
    series = [(run, "run", [(r["version"], r.get("reward")) for r in mine])]
    if control:
        series.append((control, "control", [(r["version"], r.get("reward")) for r in theirs]))
    held_out = [(r["version"], r.get("val_reward")) for r in mine if r.get("val_reward") is not None]
    if held_out:
        series.append((f"{run} held-out", "val", held_out))
    gaps = [(r["version"], r.get("logprob_gap")) for r in mine if r.get("logprob_gap") is not None]
    return {"runs": choices, "run": run, "control": control, "rows": rows, "margin": margin,
            "columns": _used(COLUMNS, rows, always=("reward", "control_reward", "logprob_gap")),
            "details": _used(DETAILS, rows), "tolerance": default,
            "chart": plot(series, label="mean reward"),
            "gap_chart": plot([(f"{run} logprob gap", "gap", gaps)], log=True, marks=[("tolerance", default)],
                              label="max |Δ logprob|")
            if gaps else None}


def _used(columns, rows: list[dict], always=()) -> list[dict]:
    """The columns a run recorded (a sync run has no rounds_done, a control no loss)."""
    return [{"key": key, "title": title, "kind": kind} for key, title, kind in columns
            if key in always or any(r["values"].get(key) is not None for r in rows)]


# -- the chart ------------------------------------------------------------------------------------
WIDTH, HEIGHT = 960, 320
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 16, 40


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round values between ``low`` and ``high`` (1, 2 or 5 times a power of ten apart)."""
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9)
    return [i * step for i in range(first, math.floor(high / step + 1e-9) + 1)]


def plot(series: list[tuple[str, str, list[tuple[int, float | None]]]], *, log: bool = False,
         marks: list[tuple[str, float]] = (), label: str = "", width: int = WIDTH, height: int = HEIGHT) -> dict:
    """Screen positions for a line chart of values per version: ``series`` is (name, key, points);
    points without a value are left out (the line joins the ones around them). ``log``: a log-10 y
    axis (values at or below zero drawn at its floor); ``marks``: labelled horizontal lines; ``label``: the y axis'."""
    values = [v for _, _, points in series for _, v in points if v is not None]
    values += [v for _, v in marks]
    versions = sorted({x for _, _, points in series for x, v in points if v is not None})
    if log:
        positive = [v for v in values if v > 0] or [1.0]
        low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
        if high - low < 2:
            low, high = low - 1, high + 1
        to_axis = lambda v: math.log10(v) if v > 0 else low  # noqa: E731 (a zero gap sits on the floor)
        ticks = [(10.0 ** e, f"1e{e}") for e in range(low, high + 1)]
    else:
        low, high = (min(values), max(values)) if values else (0.0, 1.0)
        pad = (high - low) * 0.08 or 0.5
        low, high = low - pad, high + pad
        to_axis = lambda v: v  # noqa: E731
        ticks = [(t, f"{t:g}") for t in _ticks(low, high)]
    first, last = (versions[0], versions[-1]) if versions else (0, 1)
    inner_w, inner_h = width - LEFT - RIGHT, height - TOP - BOTTOM

    def x(version):
        return LEFT + inner_w / 2 if first == last else LEFT + (version - first) / (last - first) * inner_w

    def y(value):
        return TOP + (high - to_axis(value)) / (high - low) * inner_h

    drawn = []
    for name, key, points in series:
        kept = [{"version": v, "value": value, "x": round(x(v), 1), "y": round(y(value), 1),
                 "label": fmt(value, "gap" if log else "reward")} for v, value in sorted(points) if value is not None]
        drawn.append({"name": name, "key": key, "points": kept,
                      "path": " ".join(f"{p['x']},{p['y']}" for p in kept)})
    step = max(1, math.ceil(len(versions) / 12))  # at most a dozen version labels
    return {"width": width, "height": height, "left": LEFT, "right": width - RIGHT, "top": TOP,
            "bottom": height - BOTTOM, "log": log, "label": label, "series": drawn,
            "xticks": [{"x": round(x(v), 1), "label": str(v)} for v in versions[::step]],
            "yticks": [{"y": round(y(v), 1), "label": label} for v, label in ticks],
            "marks": [{"y": round(y(v), 1), "label": f"{name} {v:g}"} for name, v in marks]}
