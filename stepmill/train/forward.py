"""The policy's logprobs on the trained tokens of a batch, in any of the three layouts, and the loss.

Layouts (``LAYOUTS``):
- ``"steps"``: one padded row per step: a step batch as verl lays it out (``step_batches`` /
  ``group_batch``: prompts left-padded, responses right-padded), or the trainer's right-padded rows of
  steps (``trajectory_batch(step_rows(...))``); one forward over the padded rows.
- ``"rows"``: a trajectory batch (``trajectory_batch``): one row per token-exact chain of steps, the
  loss on sampled tokens only; one forward over the padded rows.
- ``"tree"``: rows packed once as a prefix tree (``pack_rows``; ``pack_batch`` packs a padded batch);
  one forward over the packed tokens, each shared prefix computed once. Attention: FlexAttention with the
  tree's ``mask_mod`` when the model was loaded with ``attn_implementation="flex_attention"``
  (torch has no FlexAttention backward on the CPU, so there the CPU path is forward-only), else a
  dense 4-D mask (boolean for SDPA, additive for eager attention; T×T memory).

Every layout comes down to the same ``TokenView``: one entry per trained token (its logprob under
the model, the engine's logprob, its trajectory), plus each trajectory's reward and group. Rewards are
fields: each row's ``meta["reward"]`` (None where it has none), never read back from the token scores,
and a trajectory's is that of its last row with one; a trajectory with none is refused. A trained token
at position 0 of its sequence has no context to be predicted from and is left out (counted in
``TokenView.skipped``) in every layout alike. The trainer's own batches come from ``micro_batches``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.checkpoint

from stepmill.errors import BadInput, ConfigError
from stepmill.trainer_bridge.layouts import Batch, Row
from stepmill.trainer_bridge.prefix_tree import flex_mask_mod, pack_tree

from stepmill.train.config import LAYOUTS
from stepmill.train.engine_sync import is_peft
from stepmill.train.methods import Method, advantages, policy_loss, token_weights

ATTENTION = ("auto", "flex", "dense")


@dataclass
class TokenView:
    logprobs: torch.Tensor  # (N,) each trained token's logprob under the model (with grad when enabled)
    old_logprobs: torch.Tensor  # (N,) the engine's logprob of it: the behaviour policy
    seq_index: torch.Tensor  # (N,) long: its trajectory, an index into the per-trajectory lists
    rewards: torch.Tensor  # (S,) each trajectory's reward
    groups: list  # (S,) each trajectory's group
    trajectory_ids: list  # (S,)
    entropy: torch.Tensor | None = None  # (N,) the policy's entropy where each token was predicted
    skipped: int = 0  # trained tokens at position 0, with nothing to predict them from

    @property
    def n_seqs(self) -> int:
        return len(self.trajectory_ids)

    def lengths(self) -> torch.Tensor:
        """Trained tokens per trajectory."""
        return torch.zeros(self.n_seqs, dtype=torch.long).index_add_(
            0, self.seq_index.cpu(), torch.ones(len(self.seq_index), dtype=torch.long))


# -- the tree layout, and the plan of a batch without a forward ----------------------------------------
def pack_rows(rows: list[Row], report: Counter | None = None) -> Batch:
    """Rows (each step's, or each trajectory row's: ``Row``) packed as one prefix tree (``pack_tree``),
    with what the loss needs per sequence in CSR order beside ``seq_positions``: ``seq_log_probs`` (the
    engine's), and per sequence ``uid``, ``trajectory_id``, ``order`` and ``reward`` in ``meta``."""
    if not rows:
        raise BadInput("an empty batch has nothing to pack")
    tree = pack_tree([r.ids for r in rows], [r.loss.astype(bool) for r in rows])
    tensors = {"input_ids": tree.input_ids, "position_ids": tree.position_ids, "parent": tree.parent,
               "subtree_end": tree.subtree_end, "loss_mask": tree.loss_mask, "loss_count": tree.loss_count,
               "seq_offsets": tree.seq_offsets, "seq_positions": tree.seq_positions,
               "seq_loss_mask": tree.seq_loss_mask,
               "seq_log_probs": np.concatenate([r.logprobs for r in rows]).astype(np.float32)}
    meta = {"uid": [r.group_id for r in rows], "trajectory_id": [r.trajectory_id for r in rows],
            "order": [r.order for r in rows], "reward": [r.reward for r in rows]}
    packed = Counter(report or {})
    packed["token_ratio_permille"] = round(tree.token_ratio * 1000)
    return Batch(tensors, meta, packed)


def pack_batch(batch: Batch) -> Batch:
    """A padded step batch or trajectory batch (as verl and ``trajectory_batch`` lay them out) packed as
    one prefix tree: ``pack_rows`` of its rows, each row's real tokens."""
    if not batch.tensors:
        raise BadInput("an empty batch has nothing to pack")
    t = batch.tensors
    trained, logprobs = _full_width(batch)
    attention = t["attention_mask"].astype(bool)
    rows = [Row(tid, uid, ids=t["input_ids"][b][attention[b]], loss=trained[b][attention[b]].astype(np.int8),
                logprobs=logprobs[b][attention[b]], reward=reward, order=order)
            for b, (tid, uid, reward, order) in enumerate(zip(batch.meta["trajectory_id"], batch.meta["uid"],
                                                              batch.meta["reward"], _orders(batch)))]
    return pack_rows(rows, batch.report)


def rows_plan(rows: list[Row]) -> TokenView:
    """What a forward over ``rows`` in any layout trains on, without the forward: every trained token (its
    engine logprob and its trajectory, in row order) and each trajectory's reward and group."""
    seq_to_traj, ids, groups, rewards = _trajectories([r.trajectory_id for r in rows], [r.group_id for r in rows],
                                                      [r.order for r in rows], [r.reward for r in rows])
    trained = [np.flatnonzero(r.loss) for r in rows]
    usable = [t[t > 0] for t in trained]  # a token at position 0 has nothing to be predicted from
    seq_index = np.repeat(np.asarray(seq_to_traj, dtype=np.int64), [len(u) for u in usable])
    old = np.concatenate([r.logprobs[u] for r, u in zip(rows, usable)]) if rows else np.zeros(0, np.float32)
    return TokenView(None, torch.from_numpy(old.astype(np.float32)), torch.from_numpy(seq_index), rewards, groups, ids,
                     skipped=sum(int((t == 0).sum()) for t in trained))


def _full_width(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Trained-token mask and engine logprobs over the whole width of ``input_ids``."""
    t = batch.tensors
    if "prompts" in t:  # a step batch: the response columns follow the prompt columns
        pad = np.zeros_like(t["prompts"])
        return (np.concatenate([pad, t["response_mask"]], axis=1).astype(bool),
                np.concatenate([pad.astype(np.float32), t["rollout_log_probs"]], axis=1))
    return t["response_mask"].astype(bool), t["rollout_log_probs"]


def _orders(batch: Batch) -> list:
    """Each row's place in its trajectory: ``order``, else its step index (a step batch), else its row number."""
    if "order" in batch.meta:
        return list(batch.meta["order"])
    if "step_index" in batch.meta:
        return [float("inf") if i is None else i for i in batch.meta["step_index"]]
    return list(range(len(batch.meta["trajectory_id"])))


def _trajectories(trajectory_ids: list, groups: list, orders: list, rewards: list) -> tuple:
    """Sequences (steps or rows) to trajectories: each sequence's trajectory index, and per trajectory
    its id, group and reward: that of its last sequence with one (a reward of None is none, never 0.0)."""
    index: dict = {}
    seq_to_traj, last = [], {}
    for i, (tid, order, reward) in enumerate(zip(trajectory_ids, orders, rewards)):
        k = index.setdefault(tid, len(index))
        seq_to_traj.append(k)
        if reward is not None and (k not in last or (order, i) >= last[k][0]):
            last[k] = ((order, i), reward, groups[i])
    ids = list(index)
    missing = [t for t in ids if index[t] not in last]
    if missing:
        raise BadInput(f"trajectory {missing[0]} has no reward: leave its steps out (micro_batches.layout_batch does)")
    rewards = torch.tensor([float(last[index[t]][1]) for t in ids], dtype=torch.float64)
    return seq_to_traj, ids, [last[index[t]][2] for t in ids], rewards


# -- forwards ---------------------------------------------------------------------------------------
LOGPROB_CHUNK = 1024  # positions per lm_head → log_softmax chunk: [chunk, V] logits alive at a time


def _hidden_states(model, **inputs) -> torch.Tensor:
    """The last hidden states (B, T, H) of the model's body, before the lm_head: logits are made
    later, only where a trained token is predicted."""
    return model.get_decoder()(**inputs, use_cache=False).last_hidden_state


def _chunk_stats(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, entropy: bool):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return _token_stats(logits, targets, entropy)


def _logprobs_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, entropy: bool,
                          chunk: int = LOGPROB_CHUNK):
    """Each row of ``hidden`` (N, H) through the lm_head and a log-softmax, ``chunk`` rows at a
    time; with gradients each chunk is recomputed in the backward (checkpointed), so only its (N,)
    results are kept, never an [N, V] logits tensor."""
    head = model.get_output_embeddings()
    logps, ents = [], []
    for start in range(0, len(hidden), chunk):
        part = (hidden[start:start + chunk], head.weight, head.bias, targets[start:start + chunk],
                entropy)
        if torch.is_grad_enabled():
            logp, ent = torch.utils.checkpoint.checkpoint(_chunk_stats, *part, use_reentrant=False)
        else:
            logp, ent = _chunk_stats(*part)
        logps.append(logp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, (empty if entropy else None)
    return torch.cat(logps), (torch.cat(ents) if entropy else None)


def _token_stats(logits: torch.Tensor, targets: torch.Tensor, entropy: bool):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # log-softmax in >= float32
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
    return logp, ent


def _padded_tokens(model, batch: Batch, entropy: bool) -> tuple:
    """A padded batch's trained tokens (row-major: each row's in order): their rows, the engine's logprobs,
    and with a ``model`` its logprobs (and entropy) from one forward; the tokens at position 0 skipped."""
    t = batch.tensors
    trained, logprobs = _full_width(batch)
    positions = t["position_ids"]
    usable = trained & (positions > 0)
    rows, cols = np.nonzero(usable)
    device = model.device if model is not None else torch.device("cpu")
    logp = ent = None
    if model is not None:
        hidden = _hidden_states(model, input_ids=torch.from_numpy(t["input_ids"]).to(device),
                                attention_mask=padded_attention_mask(model, torch.from_numpy(t["attention_mask"]).to(device)),
                                position_ids=torch.from_numpy(positions).to(device))
        # the hidden state at cols - 1 predicts the token at cols
        picked = hidden[torch.from_numpy(rows).to(device), torch.from_numpy(cols - 1).to(device)]
        logp, ent = _logprobs_from_hidden(model, picked, torch.from_numpy(t["input_ids"][rows, cols]).to(device), entropy)
    return rows, torch.from_numpy(logprobs[rows, cols]).to(device), logp, ent, int((trained & (positions == 0)).sum())


def sampled_logprobs(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's and the engine's logprobs of a padded batch's trained tokens: no rewards needed."""
    _, engine, logp, _, _ = _padded_tokens(model, batch, False)
    return logp, engine


def _padded_view(model, batch: Batch, entropy: bool) -> TokenView:
    """``model=None``: the view's plan alone (which tokens, their trajectories and rewards), no forward."""
    rows, engine, logp, ent, skipped = _padded_tokens(model, batch, entropy)
    seq_to_traj, ids, groups, rewards = _trajectories(
        list(batch.meta["trajectory_id"]), list(batch.meta["uid"]), _orders(batch), list(batch.meta["reward"]))
    device = engine.device
    return TokenView(logp, engine, torch.tensor(seq_to_traj, dtype=torch.long)[torch.from_numpy(rows)].to(device),
                     rewards.to(device), groups, ids, ent, skipped)


def _implementation(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def _dense_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """A (B, 1, T, T) boolean attention pattern as the model's attention takes it: as is for SDPA,
    additive (0 or the dtype's minimum) for eager attention."""
    implementation = _implementation(model)
    if implementation == "sdpa":
        return allowed
    if implementation != "eager":
        raise ConfigError(f"a custom attention mask needs flex_attention, sdpa or eager attention, "
                          f"not {implementation}")
    return torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(model.dtype).min)


def padded_attention_mask(model, attention_mask: torch.Tensor):
    """Causal attention over each row's real tokens. A padding query attends itself alone, so no
    row is fully masked (eager attention would turn it into NaNs that reach real tokens through
    zero weights). A FlexAttention model gets the 2-D mask and builds its own BlockMask."""
    if _implementation(model) == "flex_attention":
        return attention_mask
    size = attention_mask.shape[1]
    q = torch.arange(size, device=attention_mask.device)[:, None]
    k = torch.arange(size, device=attention_mask.device)[None, :]
    allowed = ((k <= q)[None] & attention_mask.bool()[:, None, :]) | (k == q)[None]
    return _dense_mask(model, allowed[:, None])


def tree_attention_mask(model, subtree_end: np.ndarray, attention: str = "auto"):
    """What the model's attention takes for one packed tree: a FlexAttention ``BlockMask`` (when the
    model uses ``flex_attention``), or a dense (1, 1, T, T) mask: boolean for SDPA, additive for eager."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention must be one of {ATTENTION}")
    device, size = model.device, len(subtree_end)
    ends = torch.from_numpy(np.asarray(subtree_end)).to(device)
    flex = _implementation(model) == "flex_attention"
    if attention == "flex" and not flex:
        raise ConfigError("FlexAttention needs a model loaded with attn_implementation='flex_attention'")
    if attention == "dense" and flex:
        raise ConfigError("a model loaded with flex_attention takes a BlockMask; load it with 'sdpa' or 'eager'")
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(flex_mask_mod(ends), 1, None, size, size, device=device)
    q = torch.arange(size, device=device)[:, None]
    k = torch.arange(size, device=device)[None, :]
    return _dense_mask(model, ((k <= q) & (q < ends[None, :]))[None, None])  # k is q or one of its ancestors


def _tree_view(model, batch: Batch, entropy: bool, attention: str) -> TokenView:
    """``model=None``: the view's plan alone, no forward."""
    t = batch.tensors
    offsets, positions = t["seq_offsets"], t["seq_positions"]
    n = len(offsets) - 1
    entry_seq = np.repeat(np.arange(n), np.diff(offsets))  # the sequence of each CSR entry
    depth = np.arange(len(positions)) - offsets[entry_seq]  # its position in that sequence
    trained = t["seq_loss_mask"].astype(bool)
    usable = np.flatnonzero(trained & (depth > 0))
    skipped = int((trained & (depth == 0)).sum())
    seq_to_traj, ids, groups, rewards = _trajectories(
        list(batch.meta["trajectory_id"]), list(batch.meta["uid"]), list(batch.meta["order"]), list(batch.meta["reward"]))
    device = model.device if model is not None else torch.device("cpu")
    logp = ent = None
    if model is not None:
        mask = tree_attention_mask(model, t["subtree_end"], attention)
        hidden = _hidden_states(model, input_ids=torch.from_numpy(t["input_ids"])[None].to(device),
                                position_ids=torch.from_numpy(t["position_ids"])[None].to(device),
                                attention_mask=mask)[0]
        # a sequence's token j is predicted from the packed position of its token j - 1
        picked = hidden[torch.from_numpy(positions[usable - 1]).to(device)]
        logp, ent = _logprobs_from_hidden(model, picked, torch.from_numpy(t["input_ids"][positions[usable]]).to(device),
                                          entropy)
    return TokenView(logp, torch.from_numpy(t["seq_log_probs"][usable]).to(device),
                     torch.tensor(seq_to_traj, dtype=torch.long)[torch.from_numpy(entry_seq[usable])].to(device),
                     rewards.to(device), groups, ids, ent, skipped)


def check_layout(layout: str) -> None:
    """BadInput unless ``layout`` is one the trainer builds (``[train] layout``'s choices)."""
    if layout not in LAYOUTS:
        raise BadInput(f"layout must be one of {LAYOUTS}")


def token_view(model, batch: Batch, layout: str, *, entropy: bool = False, attention: str = "auto") -> TokenView:
    """The model's logprobs (and entropy) on a batch's trained tokens, as a layout-free ``TokenView``.
    Gradients flow when enabled; wrap in ``torch.no_grad()`` for a reference or old policy."""
    check_layout(layout)
    needed = ("seq_offsets", "seq_log_probs") if layout == "tree" else ("input_ids", "rollout_log_probs")
    missing = [name for name in needed if name not in batch.tensors]
    if missing:
        hint = " (pack_batch makes the tree layout)" if layout == "tree" else ""
        raise BadInput(f"not a {layout} batch: no {', '.join(missing)}{hint}")
    if layout == "tree":
        return _tree_view(model, batch, entropy, attention)
    return _padded_view(model, batch, entropy)


def view_loss(view: TokenView, method: Method, *,
              ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The method's loss on a view: advantages per trajectory, then the clipped policy loss."""
    adv = advantages(view.rewards, view.groups, method, lengths=view.lengths().to(view.rewards.device))
    loss, stats = policy_loss(view.logprobs, view.old_logprobs, adv[view.seq_index], view.seq_index, view.n_seqs,
                              method, ref_logprobs=ref_logprobs, entropy=view.entropy)
    stats.update(trajectories=view.n_seqs, skipped_tokens=view.skipped,
                 reward_mean=float(view.rewards.mean()) if view.n_seqs else 0.0)
    return loss, stats


class AdapterOff:
    """A LoRA policy's reference: the policy itself with its adapter off (peft's ``disable_adapter``), so
    the KL term's starting weights are the frozen base the policy already holds, never a copy of it.
    The switch changes the model's modules: nothing else may run the model meanwhile."""

    def __init__(self, model):
        self.model = model


@contextlib.contextmanager
def _adapter_off(model):
    """The base alone, in eval mode as a frozen reference is (no dropout); the adapter and mode restored."""
    training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(training)


def reference_logprobs(reference, batch: Batch, layout: str, attention: str = "auto") -> torch.Tensor:
    """The reference policy's logprobs on a batch's trained tokens, without gradients: ``reference`` is a
    frozen model or an ``AdapterOff``. A peft model itself is refused: its adapter is the live policy's,
    so its KL would be 0 for ever."""
    if is_peft(reference):
        raise BadInput("a LoRA policy's reference is AdapterOff(policy), not the peft model itself")
    off = isinstance(reference, AdapterOff)
    with torch.no_grad(), (_adapter_off(reference.model) if off else contextlib.nullcontext(reference)) as model:
        return token_view(model, batch, layout, attention=attention).logprobs


def loss(model, batch: Batch, layout: str, method: Method, *, reference=None, entropy: bool = False,
         attention: str = "auto") -> tuple[torch.Tensor, dict]:
    """The method's loss of ``model`` on ``batch`` (and its stats); ``reference``: the reference
    policy of a KL term (``method.kl_coef``), run without gradients on the same layout."""
    view = token_view(model, batch, layout, entropy=entropy or bool(method.entropy_coef), attention=attention)
    ref = None if reference is None else reference_logprobs(reference, batch, layout, attention)
    return view_loss(view, method, ref_logprobs=ref)


# -- micro-batches --------------------------------------------------------------------------------
MEAN_STATS = ("clip_fraction", "clip_fraction_lower", "ratio_mean", "approx_kl")  # per-token means
SUM_STATS = ("loss", "policy_loss", "kl", "entropy")  # weighted sums: a micro-batch's part of the whole


def micro_batch_loss(model, chunks: list[Batch], layout: str, plan: TokenView, method: Method, *, reference=None,
                     attention: str = "auto", backward: bool = True) -> dict:
    """The method's loss over ``chunks``, micro-batches of one batch whose ``plan`` (``token_view``
    without a model) names every trained token, its trajectory and each trajectory's reward. Each
    micro-batch's part is backpropagated (``backward``) before the next one's forward, so gradients
    accumulate to the whole batch's while one micro-batch's activations are alive: advantages and
    aggregation weights are the whole batch's, and every token weighs what it weighs in one batch."""
    entropy = bool(method.entropy_coef)
    adv = advantages(plan.rewards, plan.groups, method, lengths=plan.lengths())
    weight_of = torch.zeros(plan.n_seqs, dtype=torch.float64).index_put_(
        (plan.seq_index.cpu(),), token_weights(plan.seq_index.cpu(), plan.n_seqs, method))  # one per trajectory
    index = {trajectory: k for k, trajectory in enumerate(plan.trajectory_ids)}
    stats: dict = {"tokens": 0, "ratio_max": 1.0}
    for chunk in chunks:
        with torch.set_grad_enabled(backward):
            view = token_view(model, chunk, layout, entropy=entropy, attention=attention)
            seq = torch.tensor([index[t] for t in view.trajectory_ids], dtype=torch.long)[view.seq_index.cpu()]
            ref = None if reference is None else reference_logprobs(reference, chunk, layout, attention)
            device = view.logprobs.device
            part, part_stats = policy_loss(view.logprobs, view.old_logprobs, adv[seq].to(device), seq.to(device),
                                           plan.n_seqs, method, ref_logprobs=ref, entropy=view.entropy,
                                           weights=weight_of[seq].to(device))
        if backward and part.requires_grad:
            part.backward()
        _add_stats(stats, part_stats)
    if stats["tokens"] != len(plan.seq_index):
        raise BadInput(f"the micro-batches hold {stats['tokens']} trained tokens, the batch {len(plan.seq_index)}")
    for key in MEAN_STATS:
        stats[key] = stats.get(key, 0.0) / max(stats["tokens"], 1)
    stats.update(trajectories=plan.n_seqs, skipped_tokens=plan.skipped, micro_batches=len(chunks),
                 reward_mean=float(plan.rewards.mean()) if plan.n_seqs else 0.0)
    return stats


def _add_stats(total: dict, part: dict) -> None:
    tokens = part["tokens"]
    total["tokens"] += tokens
    total["ratio_max"] = max(total["ratio_max"], part["ratio_max"]) if tokens else total["ratio_max"]
    for key in MEAN_STATS:
        total[key] = total.get(key, 0.0) + part[key] * tokens
    for key in SUM_STATS:
        if key in part:
            total[key] = total.get(key, 0.0) + part[key]
