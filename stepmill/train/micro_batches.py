"""The claimed groups as the batch a layout trains on, cut into micro-batches of at most
``micro_batch_tokens`` real tokens (whole rows; a row longer than that is a micro-batch of its own).

One conversion per layout: the claimed step batches are read once into unpadded token rows
(``claimed_steps``), and each micro-batch is built from them directly in its layout — padded once to its
own longest row (``steps``: a row per step; ``rows``: a row per token-exact chain of steps), or packed
once as a prefix tree (``tree``: of the trajectory rows, prefixes shared within a micro-batch). The
plan every token is weighed by (``LayoutBatch.plan``) comes from the same rows, without a forward.

A step without a reward (``meta["reward"]`` None: neither the step nor its trajectory was scored) is
left out before any layout is made, and counted (``LayoutBatch.unrewarded``): it is never trained on as
a reward of 0.0, in any layout. The rest of its trajectory is trained on, its reward that of its last
rewarded step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from stepmill.trainer_bridge.layouts import Batch, Row, chain_rows, step_rows, step_tokens, trajectory_batch

from stepmill.train.forward import TokenView, check_layout, pack_rows, rows_plan


@dataclass
class LayoutBatch:
    """What one optimizer step trains on: the micro-batches of ``layout`` and the ``plan`` of every trained
    token in them (its trajectory, each trajectory's reward and group)."""

    plan: TokenView
    layout: str
    chunks: list[Batch]
    unrewarded: int = 0  # steps left out: no reward

    def __len__(self) -> int:
        return self.plan.n_seqs


def claimed_steps(batches: list[Batch]) -> dict[str, list]:
    """The claimed groups' steps (step batches, as every consumer hands them out), read once: unpadded
    token rows by trajectory (``layouts.step_tokens``)."""
    steps: dict[str, list] = {}
    for batch in batches:
        if batch.tensors:
            for trajectory_id, rows in step_tokens(batch).items():
                steps.setdefault(trajectory_id, []).extend(rows)
    return steps


def rewarded(steps: dict[str, list]) -> tuple[dict[str, list], int]:
    """The steps without those that have no reward, and how many those were."""
    kept = {t: [s for s in rows if s.reward is not None] for t, rows in steps.items()}
    left_out = sum(len(rows) for rows in steps.values()) - sum(len(rows) for rows in kept.values())
    return {t: rows for t, rows in kept.items() if rows}, left_out


def layout_batch(steps: dict[str, list], layout: str, micro_batch_tokens: int = 0) -> LayoutBatch:
    """The claimed steps (``claimed_steps``) in ``layout``, cut into micro-batches (``micro_batch_tokens``
    0: one), without their unrewarded steps (counted)."""
    check_layout(layout)
    steps, unrewarded = rewarded(steps)
    rows = step_rows(steps) if layout == "steps" else chain_rows(steps, Counter())[0]
    build = pack_rows if layout == "tree" else trajectory_batch
    chunks = [build([rows[i] for i in part]) for part in row_chunks(rows, micro_batch_tokens)] if rows else []
    return LayoutBatch(rows_plan(rows), layout, chunks, unrewarded)


def row_chunks(rows: list[Row], budget: int) -> list[list[int]]:
    """Consecutive rows, as many per chunk as fit in ``budget`` real tokens (0: all in one)."""
    if not budget:
        return [list(range(len(rows)))]
    chunks, current, used = [], [], 0
    for index, row in enumerate(rows):
        if current and used + len(row.ids) > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(index)
        used += len(row.ids)
    return chunks + ([current] if current else [])
