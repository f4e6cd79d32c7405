"""Reward-hacking signals of a version's responses, from the token ids the engine sampled: a policy
that learns to pad or to repeat itself shows here before its reward looks suspicious."""

from __future__ import annotations

import numpy as np


def responses(batches: list) -> list[np.ndarray]:
    """Each step's sampled tokens (the response, its mask applied)."""
    out = []
    for batch in batches:
        if not batch.tensors:
            continue
        ids, mask = batch.tensors["responses"], batch.tensors["response_mask"].astype(bool)
        out.extend(row[m] for row, m in zip(ids, mask))
    return out


def response_signals(batches: list) -> dict:
    """``distinct_2`` (distinct token bigrams over all bigrams), ``repetition`` (mean share of a
    response's tokens that repeat an earlier one of it), ``unique_responses`` (share of responses no
    other response equals), ``response_tokens`` (mean length)."""
    rows = responses(batches)
    if not rows:
        return {}
    bigrams, total = set(), 0
    repetition = []
    for row in rows:
        pairs = list(zip(row[:-1].tolist(), row[1:].tolist()))
        bigrams.update(pairs)
        total += len(pairs)
        if len(row):
            repetition.append(1 - len(set(row.tolist())) / len(row))
    seen: dict[bytes, int] = {}
    for row in rows:
        seen[row.tobytes()] = seen.get(row.tobytes(), 0) + 1
    return {"distinct_2": len(bigrams) / total if total else None,
            "repetition": float(np.mean(repetition)) if repetition else None,
            "unique_responses": sum(1 for c in seen.values() if c == 1) / len(rows),
            "response_tokens": float(np.mean([len(r) for r in rows]))}


def mean_reward(batches: list) -> float | None:
    """Each trajectory's reward (that of its last step with one: a step without is none, never 0.0),
    averaged over the trajectories of the groups that have one."""
    last: dict = {}
    for batch in batches:
        if not batch.tensors:
            continue
        for tid, index, reward in zip(batch.meta["trajectory_id"], batch.meta["step_index"], batch.meta["reward"]):
            key = -1 if index is None else index
            if reward is not None and (tid not in last or key >= last[tid][0]):
                last[tid] = (key, float(reward))
    return float(np.mean([v for _, v in last.values()])) if last else None
