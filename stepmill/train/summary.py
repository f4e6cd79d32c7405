"""Reward per policy version for a run beside its control, as ``stepmill train`` prints it."""

from __future__ import annotations


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def last_versions_reward(reports: list, k: int = 3) -> float | None:
    """The mean reward of the last ``k`` versions (what a run is judged by against its control)."""
    return _mean([r.metrics.get("reward") for r in reports[-k:]])


def summary_table(outcome) -> str:
    control = {r.version: r.metrics for r in outcome.control or []}
    lines = ["version  reward   control  logprob_gap  staleness  distinct_2  repetition"]

    def fmt(value, width=8):
        return f"{value:<{width}.4f}" if isinstance(value, float) else f"{'-':<{width}}"

    for report in outcome.run:
        m, c = report.metrics, control.get(report.version, {})
        lines.append(f"{report.version:<8} {fmt(m.get('reward'))} {fmt(c.get('reward'))} {fmt(m.get('logprob_gap'), 12)} "
                     f"{fmt(m.get('staleness_mean'), 10)} {fmt(m.get('distinct_2'), 11)} {fmt(m.get('repetition'))}")
    run, base = last_versions_reward(outcome.run), last_versions_reward(outcome.control or [])
    if run is not None:
        lines.append(f"last 3 versions: reward {run:.4f}" + (f", control {base:.4f}, margin {run - base:+.4f}"
                                                            if base is not None else ""))
    return "\n".join(lines)
