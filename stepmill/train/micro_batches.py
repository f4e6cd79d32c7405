"""The claimed groups as the batch a layout trains on, cut into micro-batches of at most
``micro_batch_tokens`` real tokens (whole rows; a row longer than that is a micro-batch of its own).

Each micro-batch keeps only the columns its own rows use, so a short row's micro-batch is not padded
to the longest row of the whole batch. The tree layout packs each micro-batch's rows as a tree of its
own: prefixes are shared within a micro-batch, not across them.

A step without a reward (``meta["reward"]`` None: neither the step nor its trajectory was scored) is
left out of the step batch before any layout is made from it, and counted (``LayoutBatch.unrewarded``):
it is never trained on as a reward of 0.0, in any layout. The rest of its trajectory is trained on,
its reward that of its last rewarded step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stepmill.trainer_bridge.layouts import Batch, concat_step_batches, rows_from_step_batch, trajectory_batch

from stepmill.train.forward import pack_batch

PROMPT_KEYS = ("prompts",)  # a step batch's arrays as wide as its prompts (left-padded)
FULL_KEYS = ("input_ids", "attention_mask", "position_ids")  # as wide as prompt and response together


@dataclass
class LayoutBatch:
    """What one optimizer step trains on: the padded batch every token is planned from (``padded``,
    in ``padded_layout``: steps or rows) and the micro-batches of ``layout`` cut from it."""

    padded: Batch
    padded_layout: str
    layout: str
    chunks: list[Batch]
    unrewarded: int = 0  # steps left out: no reward

    def __len__(self) -> int:
        return len(self.padded)


def layout_batch(batches: list, layout: str, micro_batch_tokens: int = 0) -> LayoutBatch:
    """The claimed groups (step batches, as every consumer hands them out) in ``layout``, cut into
    micro-batches (``micro_batch_tokens`` 0: one), without their unrewarded steps (counted)."""
    steps, unrewarded = rewarded_steps(concat_step_batches(batches))
    if not len(steps):
        return LayoutBatch(steps, "steps" if layout == "steps" else "rows", layout, [], unrewarded)
    padded = steps if layout == "steps" else trajectory_batch(*rows_from_step_batch(steps))
    parts = [trimmed(select_rows(padded, rows)) for rows in row_chunks(padded, micro_batch_tokens)]
    chunks = [pack_batch(part) for part in parts] if layout == "tree" else parts
    return LayoutBatch(padded, "steps" if layout == "steps" else "rows", layout, chunks, unrewarded)


def rewarded_steps(steps: Batch) -> tuple[Batch, int]:
    """The step batch without its steps that have no reward, and how many those were. A batch whose
    rows carry no ``reward`` field (made before steps carried it) is taken as it is."""
    rewards = steps.meta.get("reward")
    if not steps.tensors or rewards is None:
        return steps, 0
    kept = [i for i, reward in enumerate(rewards) if reward is not None]
    if len(kept) == len(rewards):
        return steps, 0
    return select_rows(steps, kept), len(rewards) - len(kept)


def row_chunks(batch: Batch, budget: int) -> list[list[int]]:
    """Consecutive rows, as many per chunk as fit in ``budget`` real tokens (0: all in one)."""
    lengths = batch.tensors["attention_mask"].sum(axis=1).tolist()
    if not budget:
        return [list(range(len(lengths)))]
    chunks, current, used = [], [], 0
    for row, length in enumerate(lengths):
        if current and used + length > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(row)
        used += length
    return chunks + ([current] if current else [])


def select_rows(batch: Batch, rows: list[int]) -> Batch:
    """The rows ``rows`` of a step or trajectory batch (tensors and per-row metadata)."""
    index = np.asarray(rows, dtype=np.int64)
    n = len(batch)
    meta = {k: ([v[i] for i in rows] if isinstance(v, list) and len(v) == n else v) for k, v in batch.meta.items()}
    return Batch({k: a[index] for k, a in batch.tensors.items()}, meta, batch.report)


def trimmed(batch: Batch) -> Batch:
    """The batch without the columns none of its rows use: a step batch's left padding of the prompts
    and right padding of the responses, a trajectory batch's right padding."""
    t = batch.tensors
    used = t["attention_mask"].astype(bool).any(axis=0)
    prompt = t["prompts"].shape[1] if "prompts" in t else 0
    first = int(np.argmax(used[:prompt])) if used[:prompt].any() else prompt  # the first prompt column used
    tail = np.flatnonzero(used[prompt:])
    end = int(tail[-1]) + 1 if len(tail) else 0  # response (or row) columns used
    columns = {**{k: slice(first, prompt) for k in PROMPT_KEYS}, **{k: slice(first, prompt + end) for k in FULL_KEYS}}
    return Batch({k: a[:, columns.get(k, slice(0, end))] for k, a in t.items()}, batch.meta, batch.report)
