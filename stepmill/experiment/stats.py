"""A cell's numbers over its seeds: each seed's run and control read into one row of numbers, then their
mean with a 95% t-interval (Student's t, seeds - 1 degrees of freedom)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from stepmill.train.summary import last_versions_reward, summary_table

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t_975(df: int) -> float:
    """The quantile for ``df`` degrees of freedom; between the table's rows the smaller df's (wider: an
    interval never narrower than it should be), past 120 the normal's 1.960."""
    if df < 1:
        raise ValueError("a t-interval needs two values or more")
    if df > 120:
        return 1.960
    return T_975[max(d for d in T_975 if d <= df)]


def interval(values: list) -> tuple[float | None, float | None]:
    """(mean, half-width of its 95% t-interval); the half-width is None for fewer than two values."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, t_975(len(values) - 1) * sd / math.sqrt(len(values))


def _mean(values: list) -> float | None:
    return interval(values)[0]


def _reports(rows: list[dict]) -> list:
    return [SimpleNamespace(metrics=row) for row in rows]


def _total(rows: list[dict], key: str) -> float:
    return sum(row.get(key) or 0.0 for row in rows)


def seed_numbers(result: dict) -> dict:
    """One seed's numbers from its result (``cell.run_cell``): the run's and control's rows per version."""
    run, control = result["run"], result.get("control") or []
    trained = [row for row in run if row.get("train_s") is not None]  # the last version is measured, not trained
    last, base = last_versions_reward(_reports(run)), last_versions_reward(_reports(control))
    per_version = [(row.get("rollout_s") or 0.0) + row["train_s"] + (row.get("sync_s") or 0.0) for row in trained]
    gaps = [row["rollout_gap"] for row in run if row.get("rollout_gap") is not None]
    return {
        "reward_v0": run[0].get("reward") if run else None,
        "last3": last, "control_last3": base,
        "margin": None if last is None or base is None else last - base,
        "s_per_version": sum(per_version) / len(per_version) if per_version else None,
        "tokens_per_s": _total(trained, "tokens") / _total(trained, "train_s") if _total(trained, "train_s") else None,
        "sync_s": _mean([row.get("sync_s") for row in run]),
        "rollout_gap": max(gaps) if gaps else None,
        "wall_s": result.get("wall_s"),
    }


def cell_numbers(results: list[dict]) -> dict:
    """A cell's numbers over its seeds: (mean, half-width) for the rewards and the margin, means for the
    costs, the largest rollout gap, and the wall seconds summed (what the cell cost)."""
    seeds = [seed_numbers(r) for r in results]
    column = {key: [s[key] for s in seeds] for key in (seeds[0] if seeds else {})}
    return {
        "seeds": len(seeds),
        **{key: interval(column.get(key, [])) for key in ("reward_v0", "last3", "control_last3", "margin")},
        **{key: _mean(column.get(key, [])) for key in ("s_per_version", "tokens_per_s", "sync_s")},
        "rollout_gap": max((g for g in column.get("rollout_gap", []) if g is not None), default=None),
        "wall_s": sum(w for w in column.get("wall_s", []) if w is not None),
    }


def seed_line(result: dict) -> str:
    """One seed's result in a line: the reward from version 0 to the last three, beside the control."""
    numbers = seed_numbers(result)
    shown = {k: ("–" if v is None else f"{v:.3f}") for k, v in numbers.items()}
    margin = "–" if numbers["margin"] is None else f"{numbers['margin']:+.3f}"
    return (f"reward {shown['reward_v0']} → {shown['last3']} over the last 3 versions (control {shown['control_last3']}, "
            f"margin {margin}) in {numbers['wall_s']:.0f} s")


def seed_table(result: dict) -> str:
    """One seed's reward per version beside its control, as ``stepmill train`` prints it."""
    def reports(rows):
        return [SimpleNamespace(version=row["version"], metrics=row) for row in rows]

    return summary_table(SimpleNamespace(run=reports(result["run"]), control=reports(result.get("control") or [])))
