"""RL methods by name: advantages per trajectory and a PPO-style clipped policy loss (pure torch).

Everything works on a flat view of the trained tokens (see ``forward``): one entry per sampled
token with its logprob under the model, the engine's logprob (the behaviour policy) and the
index of its trajectory. The unit of advantages and of sequence-level normalisation is the
trajectory, never the padded step or row, so every layout of the same group gives the same loss.

Methods (``METHODS``):
- ``grpo``: reward minus the group mean, divided by the group's standard deviation (unbiased,
  as torch.std) plus ``epsilon``.
- ``dr_grpo`` (Dr. GRPO, Liu et al. 2025): no division by the std, and the token losses summed
  and divided by a constant (``norm_length`` tokens per trajectory) instead of each length.
- ``rloo``: reward minus the mean of the other members of its group.
- ``reinforce_pp`` (REINFORCE++): rewards whitened across the batch; ``reinforce_pp_baseline``
  subtracts the group mean first. Whitening weighs each trajectory by its trained tokens, as the
  token-level whitening of REINFORCE++ does, when ``lengths`` are given.

A group of one trajectory has no baseline to compare with: its group-baselined advantage is 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from stepmill.errors import ConfigError

BASELINES = ("group_mean", "leave_one_out", "none")
SCALES = ("group_std", "none")
AGGREGATIONS = ("token", "sequence", "sum_norm")
KL_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class Method:
    name: str
    baseline: str = "group_mean"  # BASELINES
    scale: str = "group_std"  # SCALES
    whiten: bool = False  # advantages whitened across the batch (REINFORCE++)
    aggregation: str = "token"  # AGGREGATIONS: token mean, mean of trajectory means, sum / constant
    norm_length: int | None = None  # "sum_norm": tokens per trajectory of the constant (the generation budget)
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # dual clip: a negative advantage's loss is capped at -A * c (None: off)
    kl_coef: float = 0.0  # weight of the KL to a reference policy (needs reference logprobs)
    kl_estimator: str = "k3"  # KL_ESTIMATORS
    entropy_coef: float = 0.0  # an entropy bonus (needs the entropy)
    epsilon: float = 1e-6  # added to the std before dividing

    def __post_init__(self):
        for value, allowed, what in ((self.baseline, BASELINES, "baseline"), (self.scale, SCALES, "scale"),
                                     (self.aggregation, AGGREGATIONS, "aggregation"),
                                     (self.kl_estimator, KL_ESTIMATORS, "kl_estimator")):
            if value not in allowed:
                raise ConfigError(f"{self.name}: {what} must be one of {allowed}, not {value!r}")
        if self.norm_length is not None and self.norm_length <= 0:
            raise ConfigError(f"{self.name}: norm_length is a positive number of tokens")
        if self.clip_low < 0 or self.clip_high < 0 or (self.clip_ratio_c is not None and self.clip_ratio_c <= 1):
            raise ConfigError(f"{self.name}: clip_low and clip_high are >= 0 and clip_ratio_c > 1")


METHODS: dict[str, Method] = {
    "grpo": Method("grpo"),
    # norm_length has no sensible default: method("dr_grpo", norm_length=<max new tokens>) sets it
    "dr_grpo": Method("dr_grpo", scale="none", aggregation="sum_norm"),
    "rloo": Method("rloo", baseline="leave_one_out", scale="none"),
    "reinforce_pp": Method("reinforce_pp", baseline="none", scale="none", whiten=True),
    "reinforce_pp_baseline": Method("reinforce_pp_baseline", baseline="group_mean", scale="none", whiten=True),
}


def method(name: str, **options) -> Method:
    """The method ``name`` with some options changed (``method("grpo", aggregation="sequence")``)."""
    if name not in METHODS:
        raise ConfigError(f"unknown RL method {name!r}; known: {', '.join(METHODS)}")
    fields = {f.name for f in dataclasses.fields(Method)} - {"name"}
    unknown = set(options) - fields
    if unknown:
        raise ConfigError(f"unknown method options {sorted(unknown)}; known: {sorted(fields)}")
    return dataclasses.replace(METHODS[name], **options)


def group_index(groups: Sequence) -> torch.Tensor:
    """Group labels (any hashable, in any order) as indices 0..G-1 in order of first appearance."""
    seen: dict = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in groups], dtype=torch.long)


def advantages(rewards: torch.Tensor, groups: Sequence | torch.Tensor, method: Method,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per trajectory. ``groups``: each trajectory's group (labels or indices);
    ``lengths``: trained tokens per trajectory, the weights of REINFORCE++'s whitening (each
    trajectory weighs 1 without them)."""
    rewards = torch.as_tensor(rewards).detach()
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    index = groups if isinstance(groups, torch.Tensor) else group_index(groups)
    index = index.to(torch.long)
    if index.shape != rewards.shape:
        raise ValueError("one group per reward")
    n = len(rewards)
    if n == 0:
        return rewards.clone()
    size = torch.zeros(int(index.max()) + 1, dtype=rewards.dtype).index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros_like(size).index_add_(0, index, rewards)
    k, s = size[index], total[index]
    alone = k < 2
    if method.baseline == "group_mean":
        scores = rewards - s / k
    elif method.baseline == "leave_one_out":
        scores = rewards - (s - rewards) / (k - 1).clamp(min=1)
    else:
        scores = rewards.clone()
    if method.baseline != "none":
        scores = torch.where(alone, torch.zeros_like(scores), scores)
    if method.scale == "group_std":
        mean = (total / size)[index]
        squares = torch.zeros_like(size).index_add_(0, index, (rewards - mean) ** 2)
        std = (squares / (size - 1).clamp(min=1)).sqrt()[index]  # unbiased, as torch.std
        scores = scores / (std + method.epsilon)
    if method.whiten:
        weights = torch.ones_like(scores) if lengths is None else torch.as_tensor(lengths).to(scores.dtype)
        count = weights.sum()
        mean = (weights * scores).sum() / count
        var = (weights * (scores - mean) ** 2).sum() / count
        var = var * count / (count - 1) if count > 1 else var  # unbiased, as REINFORCE++'s masked whitening
        scores = (scores - mean) * torch.rsqrt(var + 1e-8)
    return scores


def token_weights(seq_index: torch.Tensor, n_seqs: int, method: Method, dtype=torch.float64) -> torch.Tensor:
    """Each token's weight in the method's aggregation, so that the loss is ``(values * weights).sum()``:
    "token" 1/N, "sequence" 1/(its trajectory's tokens × trajectories with tokens), "sum_norm"
    1/(trajectories with tokens × norm_length). Weights over a whole batch let micro-batches sum to it."""
    if method.aggregation == "token":
        return torch.full(seq_index.shape, 1.0 / max(seq_index.numel(), 1), dtype=dtype, device=seq_index.device)
    counts = torch.zeros(n_seqs, dtype=dtype, device=seq_index.device).index_add_(
        0, seq_index, torch.ones(seq_index.shape, dtype=dtype, device=seq_index.device))
    present = max(int((counts > 0).sum()), 1)
    if method.aggregation == "sequence":
        return 1.0 / (counts[seq_index] * present)
    if not method.norm_length:
        raise ConfigError(f"{method.name}: aggregation 'sum_norm' needs norm_length (the generation budget in tokens)")
    return torch.full(seq_index.shape, 1.0 / (present * method.norm_length), dtype=dtype, device=seq_index.device)


def aggregate(values: torch.Tensor, seq_index: torch.Tensor, n_seqs: int, method: Method,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token values to a scalar: "token" (their mean), "sequence" (the mean over trajectories
    with trained tokens of each one's mean), "sum_norm" (their sum / (trajectories * norm_length));
    ``weights``: the tokens' ``token_weights`` over a larger batch this one is part of."""
    if values.numel() == 0:
        return values.sum()
    if weights is None:
        weights = token_weights(seq_index, n_seqs, method, values.dtype)
    return (values * weights.to(values.dtype)).sum()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference): k1 = log p - log q; k3 = q/p - log(q/p) - 1 (unbiased,
    never negative), clamped to [-10, 10] as is customary for low-variance KL."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, token_advantages: torch.Tensor,
                seq_index: torch.Tensor, n_seqs: int, method: Method, *, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate on flat trained tokens (all 1-D, one entry a token). ``old_logprobs``:
    the engine's (behaviour policy); ``weights``: the tokens' aggregation weights when they are one
    micro-batch of a larger batch (``token_weights`` over it). Returns the loss and its stats (floats): clip fractions, ratio
    mean and max, the policy's approximate KL to the behaviour policy, KL to the reference, entropy."""
    old = old_logprobs.to(logprobs.dtype)
    adv = token_advantages.to(logprobs.dtype)
    log_ratio = (logprobs - old).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - method.clip_low, 1 + method.clip_high)
    clipped = torch.maximum(loss1, loss2)
    losses = clipped
    lower = torch.zeros_like(clipped, dtype=torch.bool)
    if method.clip_ratio_c is not None:
        loss3 = -adv * method.clip_ratio_c
        lower = (clipped > loss3) & (adv < 0)
        losses = torch.where(adv < 0, torch.minimum(clipped, loss3), clipped)
    loss = aggregate(losses, seq_index, n_seqs, method, weights)
    stats = {}
    with torch.no_grad():
        count = max(logprobs.numel(), 1)
        stats["clip_fraction"] = float((loss2 > loss1).sum()) / count
        stats["clip_fraction_lower"] = float(lower.sum()) / count
        stats["ratio_mean"] = float(ratio.sum()) / count
        stats["ratio_max"] = float(ratio.max()) if ratio.numel() else 1.0
        stats["approx_kl"] = float((-log_ratio).sum()) / count
        stats["policy_loss"] = float(loss.detach())
        stats["tokens"] = logprobs.numel()
    if method.kl_coef:
        if ref_logprobs is None:
            raise ConfigError(f"{method.name}: kl_coef needs the reference policy's logprobs")
        kl = aggregate(kl_penalty(logprobs, ref_logprobs.to(logprobs.dtype), method.kl_estimator), seq_index,
                       n_seqs, method, weights)
        loss = loss + method.kl_coef * kl
        stats["kl"] = float(kl.detach())
    if entropy is not None:
        mean_entropy = aggregate(entropy, seq_index, n_seqs, method, weights)
        if method.entropy_coef:
            loss = loss - method.entropy_coef * mean_entropy
        stats["entropy"] = float(mean_entropy.detach())
    elif method.entropy_coef:
        raise ConfigError(f"{method.name}: entropy_coef needs the entropy")
    stats["loss"] = float(loss.detach())
    return loss, stats
