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


def _trajectory_rewards(batch) -> dict:
    """Each trajectory's reward in one claimed group: that of its last step with one (a step without is
    none, never 0.0; a step of no known index counts as last, as the trainer orders it); a trajectory with
    no rewarded step is absent."""
    last: dict = {}
    for tid, index, reward in zip(batch.meta["trajectory_id"], batch.meta["step_index"], batch.meta["reward"]):
        key = float("inf") if index is None else index
        if reward is not None and (tid not in last or key >= last[tid][0]):
            last[tid] = (key, float(reward))
    return {tid: reward for tid, (_, reward) in last.items()}


def mean_reward(batches: list) -> float | None:
    """The trajectories' rewards averaged over the groups that have one."""
    rewards = [r for batch in batches if batch.tensors for r in _trajectory_rewards(batch).values()]
    return float(np.mean(rewards)) if rewards else None


def flat_groups(batches: list) -> float | None:
    """The share of groups (of two or more rewarded trajectories) whose rewards are all equal: a
    group-relative method (GRPO, Dr. GRPO, RLOO) learns nothing from them. Near 1 it says the rollouts
    do not differ (greedy decoding, a reward that cannot tell them apart) before a flat reward curve
    does. A group with one rewarded trajectory has no baseline either; it is not counted here."""
    spreads = [np.ptp(list(rewards.values())) for batch in batches if batch.tensors
               for rewards in [_trajectory_rewards(batch)] if len(rewards) >= 2]
    return float(np.mean([spread == 0 for spread in spreads])) if spreads else None
