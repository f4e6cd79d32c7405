"""Curated steps as trainer batches (numpy), read through the curation gate.

- ``step_batches``: one row per step in verl's names: ``prompts`` (left-padded), ``responses``
  (right-padded), ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``,
  ``rollout_log_probs``, ``token_level_scores`` (the effective reward on the last response token),
  and per row ``uid`` (group), ``trajectory_id``, ``step_id``, ``step_index``, ``policy_version``,
  ``reward`` (None where the step has none, which ``token_level_scores`` cannot tell from 0.0).
- ``trajectory_rows``: a trajectory whose steps continue each other token-exactly is one row;
  ``response_mask`` covers only what the model sampled (tool results, user turns and template
  tokens between turns are context). Where a step does not continue its parent, a new row starts.
- ``tree_batch``: every sequence of a group packed once (see ``prefix_tree``).

Steps are read as token rows (``Store.token_rows``): ids rebuilt from the stored deltas, never the
conversations. Nothing is dropped silently: steps without ids, overlong rows (dropped or truncated,
by an explicit policy) and row breaks are counted in each batch's ``report``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import numpy as np

from stepmill.errors import BadInput
from stepmill.store import Store

from stepmill.trainer_bridge.prefix_tree import PackedTree, pack_tree

OVERLONG = ("drop", "truncate")
NO_IDS = "left out: no token ids (run stepmill tokenize)"


@dataclass
class Batch:
    tensors: dict[str, np.ndarray]
    meta: dict[str, list]
    report: Counter = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.meta.get("step_id") or self.meta.get("trajectory_id") or [])

    def to_torch(self) -> dict:
        """The same arrays as torch tensors, sharing memory (torch is an optional extra)."""
        import torch

        return {name: torch.from_numpy(array) for name, array in self.tensors.items()}

    def to_dataproto(self):
        """A verl ``DataProto`` (verl is an optional extra): the arrays as its batch, the per-row
        metadata as its non-tensor batch, the counts as its meta_info."""
        from verl import DataProto

        rows = {name: np.array(values, dtype=object) for name, values in self.meta.items()
                if isinstance(values, list) and len(values) == len(self)}
        return DataProto.from_dict(tensors=self.to_torch(), non_tensors=rows, meta_info={"report": dict(self.report)})


def _steps(store: Store, where: str | None, params: Any, group_id: str | None = None,
           trajectory_ids: Iterable[str] | None = None) -> Iterator:
    """The selected steps' token rows (``store/token_rows.py``), through the curation gate."""
    return store.token_rows(where, params, gate=True, group_id=group_id, trajectory_ids=trajectory_ids)


def step_batches(store: Store, *, where: str | None = None, params: Any = (), group_id: str | None = None,
                 trajectory_ids: Iterable[str] | None = None, batch_size: int = 64,
                 max_prompt_length: int = 4096, max_response_length: int = 2048, overlong: str = "drop",
                 pad_id: int = 0) -> Iterator[Batch]:
    """Gated steps with token ids, ``batch_size`` rows at a time (``trajectory_ids``: only those runs')."""
    if overlong not in OVERLONG:
        raise BadInput(f"overlong must be one of {OVERLONG}")
    rows, report = [], Counter()
    for step in _steps(store, where, params, group_id, trajectory_ids):
        if not step.has_ids:
            report[NO_IDS] += 1
            continue
        prompt, response, logprobs = step.prompt_ids, step.response_ids, step.logprobs
        if len(prompt) > max_prompt_length or len(response) > max_response_length:
            if overlong == "drop":
                report["dropped: overlong"] += 1
                continue
            report["truncated: overlong"] += 1
            prompt = prompt[-max_prompt_length:]  # keep the end of the prompt, next to the response
            response = response[:max_response_length]
            logprobs = logprobs[:max_response_length] if logprobs is not None else None
        rows.append((step, prompt, response, logprobs))
        if len(rows) == batch_size:
            yield _step_batch(rows, report, pad_id)
            rows, report = [], Counter()
    if rows or report:
        yield _step_batch(rows, report, pad_id)


def group_batch(store: Store, group_id: str, *, trajectory_ids: Iterable[str] | None = None, **layout) -> Batch:
    """A group's gated steps (only those of ``trajectory_ids`` when given) as one step batch, with
    ``meta["group_id"]``: what a consumer hands a trainer. ``layout``: the options of ``step_batches``."""
    batches = list(step_batches(store, group_id=group_id, trajectory_ids=trajectory_ids,
                                **{"batch_size": 1 << 30, **layout}))
    batch = batches[0] if batches else Batch({}, {"step_id": []})
    batch.meta["group_id"] = group_id
    return batch


def _step_batch(rows: list, report: Counter, pad_id: int) -> Batch:
    n = len(rows)
    p = max((len(r[1]) for r in rows), default=0)
    r = max((len(r[2]) for r in rows), default=0)
    prompts = np.full((n, p), pad_id, dtype=np.int64)
    responses = np.full((n, r), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((n, p), dtype=np.int64)
    response_mask = np.zeros((n, r), dtype=np.int64)
    log_probs = np.zeros((n, r), dtype=np.float32)
    scores = np.zeros((n, r), dtype=np.float32)
    meta: dict[str, list] = {k: [] for k in ("uid", "trajectory_id", "step_id", "step_index", "parent_step_id",
                                             "policy_version", "reward")}
    for i, (step, prompt, response, logprobs) in enumerate(rows):
        if len(prompt):
            prompts[i, p - len(prompt):] = prompt
            prompt_mask[i, p - len(prompt):] = 1
        responses[i, :len(response)] = response
        response_mask[i, :len(response)] = 1
        if logprobs is not None:
            log_probs[i, :len(logprobs)] = logprobs
        if step.reward is not None and len(response):
            scores[i, len(response) - 1] = step.reward
        meta["uid"].append(step.group_id)
        meta["trajectory_id"].append(step.trajectory_id)
        meta["step_id"].append(step.step_id)
        meta["step_index"].append(step.step_index)
        meta["parent_step_id"].append(step.parent_step_id)
        meta["policy_version"].append(step.policy_version)
        meta["reward"].append(step.reward)  # None where unscored: token_level_scores holds 0.0 there
    attention_mask = np.concatenate([prompt_mask, response_mask], axis=1)
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)
    tensors = {"prompts": prompts, "responses": responses, "input_ids": np.concatenate([prompts, responses], axis=1),
               "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask,
               "rollout_log_probs": log_probs, "token_level_scores": scores}
    report["rows"] += n
    return Batch(tensors, meta, report)


def concat_step_batches(batches: list[Batch], pad_id: int = 0) -> Batch:
    """Step batches (of one group fetched from several nodes) as one: prompts re-padded on the left,
    responses on the right, the joined arrays built again; metadata and counts added up."""
    batches = [b for b in batches if b.tensors]
    if len(batches) <= 1:
        return batches[0] if batches else Batch({}, {"step_id": []})
    p = max((b.tensors["prompts"].shape[1] for b in batches), default=0)
    r = max((b.tensors["responses"].shape[1] for b in batches), default=0)

    def padded(array, width, value, left):
        missing = width - array.shape[1]
        return np.pad(array, ((0, 0), (missing, 0) if left else (0, missing)), constant_values=value)

    parts: dict[str, list] = {k: [] for k in ("prompts", "prompt_mask", "responses", "response_mask",
                                              "rollout_log_probs", "token_level_scores")}
    meta: dict[str, list] = {}
    report: Counter = Counter()
    for b in batches:
        t, width = b.tensors, b.tensors["prompts"].shape[1]
        parts["prompts"].append(padded(t["prompts"], p, pad_id, True))
        parts["prompt_mask"].append(padded(t["attention_mask"][:, :width], p, 0, True))
        parts["responses"].append(padded(t["responses"], r, pad_id, False))
        for name in ("response_mask", "rollout_log_probs", "token_level_scores"):
            parts[name].append(padded(t[name], r, 0, False))
        for key, values in b.meta.items():
            if isinstance(values, list):
                meta.setdefault(key, []).extend(values)
            else:
                meta[key] = values
        report.update(b.report)
    joined = {name: np.concatenate(arrays) for name, arrays in parts.items()}
    attention_mask = np.concatenate([joined.pop("prompt_mask"), joined["response_mask"]], axis=1)
    tensors = {"prompts": joined["prompts"], "responses": joined["responses"],
               "input_ids": np.concatenate([joined["prompts"], joined["responses"]], axis=1),
               "attention_mask": attention_mask,
               "position_ids": np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None),
               "response_mask": joined["response_mask"], "rollout_log_probs": joined["rollout_log_probs"],
               "token_level_scores": joined["token_level_scores"]}
    return Batch(tensors, meta, report)


@dataclass
class Row:
    trajectory_id: str
    group_id: str
    step_ids: list = field(default_factory=list)
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))  # 1 where the model sampled the token
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    reward: float | None = None  # its last rewarded step's
    order: float = 0.0  # its place in its trajectory: its step index (a step's row), or its row number


def trajectory_rows(store: Store, *, where: str | None = None, params: Any = (),
                    group_id: str | None = None) -> tuple[list[Row], Counter]:
    """One row per token-exact chain of steps; a step that does not continue its parent starts a new row."""
    report: Counter = Counter()
    by_trajectory: dict[str, list] = {}
    for step in _steps(store, where, params, group_id):
        if not step.has_ids:
            report[NO_IDS] += 1
            continue
        by_trajectory.setdefault(step.trajectory_id, []).append(step)
    return chain_rows(by_trajectory, report)


def step_tokens(batch: Batch) -> dict[str, list]:
    """A step batch's steps (what a consumer hands out) as unpadded token rows, by trajectory: each step's
    prompt and response ids, engine logprobs, reward (``meta["reward"]``: None where it has none) and
    policy version; what ``chain_rows`` and ``step_rows`` read."""
    by_trajectory: dict[str, list] = {}
    t, meta = batch.tensors, batch.meta
    for i, step_id in enumerate(meta.get("step_id", [])):
        prompt = t["prompts"][i][t["attention_mask"][i, :t["prompts"].shape[1]].astype(bool)]
        response_mask = t["response_mask"][i].astype(bool)
        by_trajectory.setdefault(meta["trajectory_id"][i], []).append(SimpleNamespace(
            step_id=step_id, trajectory_id=meta["trajectory_id"][i], group_id=meta["uid"][i],
            parent_step_id=meta["parent_step_id"][i], step_index=meta["step_index"][i],
            policy_version=meta["policy_version"][i], reward=meta["reward"][i], prompt_ids=prompt,
            response_ids=t["responses"][i][response_mask], logprobs=t["rollout_log_probs"][i][response_mask]))
    return by_trajectory


def rows_from_step_batch(batch: Batch) -> tuple[list[Row], Counter]:
    """The trajectory rows of a step batch (what a consumer hands out), chained as ``trajectory_rows``
    chains the store's steps: a trainer can take any layout from any consumer."""
    return chain_rows(step_tokens(batch), Counter(batch.report))


def step_rows(by_trajectory: dict[str, list]) -> list[Row]:
    """Each step (token rows with ids, by trajectory) as a row of its own: its prompt as context, its
    response trained on, ordered by its step index."""
    rows = []
    for trajectory_id, steps in by_trajectory.items():
        for step in steps:
            prompt, response = np.asarray(step.prompt_ids, np.int64), np.asarray(step.response_ids, np.int64)
            logprobs = np.zeros(len(response), np.float32) if step.logprobs is None else step.logprobs
            rows.append(Row(trajectory_id, step.group_id, [step.step_id], np.concatenate([prompt, response]),
                            np.concatenate([np.zeros(len(prompt), np.int8), np.ones(len(response), np.int8)]),
                            np.concatenate([np.zeros(len(prompt), np.float32), np.asarray(logprobs, np.float32)]),
                            step.reward, float("inf") if step.step_index is None else step.step_index))
    return rows


def chain_rows(by_trajectory: dict[str, list], report: Counter) -> tuple[list[Row], Counter]:
    """Each trajectory's steps (token rows with ids) as rows: a step that continues its parent
    token-exactly extends the row (what lies between is context), any other starts a new one."""
    rows, parts = [], []  # parts: each row's loss and logprob pieces, joined once at the end
    for trajectory_id, steps in by_trajectory.items():
        steps.sort(key=lambda s: (s.step_index is None, s.step_index))
        row, number = None, 0  # number: the rows this trajectory has so far
        for step in steps:
            prompt = np.asarray(step.prompt_ids, dtype=np.int64)
            response = np.asarray(step.response_ids, dtype=np.int64)
            n = 0 if row is None else len(row.ids)
            continues = row is not None and step.parent_step_id == row.step_ids[-1] and len(prompt) >= n \
                and np.array_equal(prompt[:n], row.ids)
            if not continues:
                if row is not None:
                    report["new row: a step does not continue its parent token-exactly"] += 1
                row, number = Row(trajectory_id, step.group_id, order=number), number + 1
                rows.append(row)
                parts.append(([row.loss], [row.logprobs]))
                n = 0
            context = prompt[n:]  # tool results, user turns, template tokens: context, not trained on
            logprobs = np.asarray(step.logprobs if step.logprobs is not None else np.zeros(len(response)),
                                  dtype=np.float32)
            row.ids = np.concatenate([prompt, response])  # the row so far: it starts with this prompt
            parts[-1][0].extend((np.zeros(len(context), np.int8), np.ones(len(response), np.int8)))
            parts[-1][1].extend((np.zeros(len(context), np.float32), logprobs))
            row.step_ids.append(step.step_id)
            row.reward = step.reward if step.reward is not None else row.reward
    for row, (loss, logprobs) in zip(rows, parts):
        row.loss, row.logprobs = np.concatenate(loss), np.concatenate(logprobs)
    report["rows"] = len(rows)
    return rows, report


def trajectory_batch(rows: list[Row], report: Counter | None = None, pad_id: int = 0) -> Batch:
    """Right-padded rows: input_ids, attention_mask, position_ids, response_mask (sampled tokens only),
    rollout_log_probs, token_level_scores (the reward on the row's last sampled token, as verl takes it);
    per row ``reward`` (None where it has none, which the scores cannot tell from 0.0) and ``order``."""
    n, width = len(rows), max((len(r.ids) for r in rows), default=0)
    input_ids = np.full((n, width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((n, width), dtype=np.int64)
    response_mask = np.zeros((n, width), dtype=np.int64)
    log_probs = np.zeros((n, width), dtype=np.float32)
    scores = np.zeros((n, width), dtype=np.float32)
    for i, row in enumerate(rows):
        k = len(row.ids)
        input_ids[i, :k] = row.ids
        attention_mask[i, :k] = 1
        response_mask[i, :k] = row.loss
        log_probs[i, :k] = row.logprobs
        sampled = np.flatnonzero(row.loss)
        if row.reward is not None and len(sampled):
            scores[i, sampled[-1]] = row.reward
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask,
               "position_ids": np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None),
               "response_mask": response_mask, "rollout_log_probs": log_probs, "token_level_scores": scores}
    meta = {"uid": [r.group_id for r in rows], "trajectory_id": [r.trajectory_id for r in rows],
            "step_ids": [r.step_ids for r in rows], "reward": [r.reward for r in rows],
            "order": [r.order for r in rows]}
    return Batch(tensors, meta, Counter(report or {}))


def tree_batch(store: Store, group_id: str, *, rows: bool = False) -> tuple[PackedTree, Batch]:
    """A group packed as one tree: every step (prompt + response, loss on the response), or with
    ``rows`` every trajectory row (loss on sampled tokens)."""
    if rows:
        trajectory, report = trajectory_rows(store, group_id=group_id)
        sequences = [r.ids for r in trajectory]
        masks = [r.loss.astype(bool) for r in trajectory]
        meta = {"trajectory_id": [r.trajectory_id for r in trajectory], "step_ids": [r.step_ids for r in trajectory]}
    else:
        report, sequences, masks, meta = Counter(), [], [], {"step_id": []}
        for step in _steps(store, None, (), group_id):
            if not step.has_ids:
                report[NO_IDS] += 1
                continue
            sequences.append(step.ids())
            masks.append(step.loss_mask())
            meta["step_id"].append(step.step_id)
    tree = pack_tree(sequences, masks)
    report["token_ratio_permille"] = round(tree.token_ratio * 1000)
    tensors = {"input_ids": tree.input_ids, "position_ids": tree.position_ids, "subtree_end": tree.subtree_end,
               "loss_mask": tree.loss_mask, "loss_count": tree.loss_count, "seq_offsets": tree.seq_offsets,
               "seq_positions": tree.seq_positions}
    return tree, Batch(tensors, meta, report)
