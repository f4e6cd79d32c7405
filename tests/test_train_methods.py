"""RL methods: advantages and the clipped loss against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from stepmill.errors import ConfigError  # noqa: E402
from stepmill.train.methods import METHODS, advantages, aggregate, kl_penalty, method, policy_loss  # noqa: E402

# three groups: a (three runs), b (two), c (one, alone)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 3.0], dtype=torch.float64)
GROUPS = ["a", "a", "a", "b", "b", "c"]


def test_group_baselines_by_hand():
    eps = 1e-6
    grpo = advantages(REWARDS, GROUPS, METHODS["grpo"])
    # a: mean 0.5, unbiased std 0.5; b: mean 1, std sqrt(2); c alone: no baseline, 0
    expected = [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.0, 1 / (math.sqrt(2) + eps), -1 / (math.sqrt(2) + eps), 0.0]
    assert grpo.tolist() == pytest.approx(expected, abs=1e-12)
    assert advantages(REWARDS, GROUPS, METHODS["dr_grpo"]).tolist() == pytest.approx([0.5, -0.5, 0, 1, -1, 0])
    # each minus the mean of the others in its group
    assert advantages(REWARDS, GROUPS, METHODS["rloo"]).tolist() == pytest.approx([0.75, -0.75, 0, 2, -2, 0])


def test_reinforce_pp_whitens_across_the_batch_by_tokens():
    r = REWARDS.numpy()
    plain = advantages(REWARDS, GROUPS, METHODS["reinforce_pp"])
    assert plain.tolist() == pytest.approx(((r - r.mean()) / math.sqrt(r.var(ddof=1) + 1e-8)).tolist(), abs=1e-12)
    # with lengths: every trained token carries its trajectory's score, whitened over tokens
    lengths = torch.tensor([3, 1, 2, 5, 1, 4])
    centred = np.array([0.5, -0.5, 0.0, 1.0, -1.0, 0.0])  # group means off; c alone: 0
    tokens = np.repeat(centred, lengths.numpy())
    expected = (centred - tokens.mean()) / math.sqrt(tokens.var(ddof=1) + 1e-8)
    got = advantages(REWARDS, GROUPS, METHODS["reinforce_pp_baseline"], lengths=lengths)
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.floats(-10, 10)), min_size=1, max_size=24),
       st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_group_baselined_advantages_sum_to_zero_per_group(runs, name):
    groups = [g for g, _ in runs]
    adv = advantages(torch.tensor([r for _, r in runs], dtype=torch.float64), groups, METHODS[name])
    assert torch.isfinite(adv).all()
    for group in set(groups):
        members = [a for a, g in zip(adv.tolist(), groups) if g == group]
        assert abs(sum(members)) < 1e-6 * max(1.0, max(abs(a) for a in members))


def test_the_clipped_loss_by_hand():
    # token 0: A=1, ratio 1.1 (inside); token 1: A=1, ratio 1.5 (clipped at 1.2); token 2: A=-1, ratio 4
    # (past the dual clip: the loss is capped at -A * 3)
    old = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    new = (old + torch.log(torch.tensor([1.1, 1.5, 4.0], dtype=torch.float64))).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1])
    for aggregation, expected in (("token", (-1.1 - 1.2 + 3) / 3), ("sequence", ((-1.1 - 1.2) / 2 + 3) / 2),
                                  ("sum_norm", (-1.1 - 1.2 + 3) / (2 * 10))):
        value, stats = policy_loss(new, old, adv, seq, 2, method("grpo", aggregation=aggregation, norm_length=10))
        assert value.item() == pytest.approx(expected, abs=1e-12), aggregation
    assert stats["clip_fraction"] == pytest.approx(1 / 3) and stats["clip_fraction_lower"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx((1.1 + 1.5 + 4) / 3)
    value, _ = policy_loss(new, old, adv, seq, 2, METHODS["grpo"])
    value.backward()
    assert new.grad.tolist() == pytest.approx([-1.1 / 3, 0.0, 0.0], abs=1e-12)  # clipped tokens carry no gradient
    no_dual = method("grpo", clip_ratio_c=None)
    assert policy_loss(new, old, adv, seq, 2, no_dual)[0].item() == pytest.approx((-1.1 - 1.2 + 4) / 3)
    wider = method("grpo", clip_high=0.28)  # DAPO's clip-higher
    assert policy_loss(new, old, adv, seq, 2, wider)[0].item() == pytest.approx((-1.1 - 1.28 + 3) / 3)


def test_kl_estimators_and_the_kl_term():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    d = (ref - logp).numpy()
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx((np.exp(d) - d - 1).tolist())
    seq = torch.tensor([0, 0])
    rl = method("grpo", kl_coef=0.5, kl_estimator="k1")
    value, stats = policy_loss(logp, logp, torch.zeros(2, dtype=torch.float64), seq, 1, rl, ref_logprobs=ref)
    assert stats["kl"] == pytest.approx(-0.25) and value.item() == pytest.approx(0.5 * -0.25)
    with pytest.raises(ConfigError, match="reference"):
        policy_loss(logp, logp, torch.zeros(2), seq, 1, rl)


def test_aggregations_skip_trajectories_without_tokens():
    values = torch.tensor([1.0, 3.0, 5.0])
    seq = torch.tensor([0, 0, 2])  # trajectory 1 has no trained token
    assert aggregate(values, seq, 3, method("grpo", aggregation="sequence")).item() == pytest.approx((2 + 5) / 2)
    assert aggregate(values, seq, 3, method("grpo", aggregation="sum_norm", norm_length=4)).item() == pytest.approx(9 / 8)


def test_bad_method_options():
    with pytest.raises(ConfigError, match="unknown RL method"):
        method("ppo2")
    with pytest.raises(ConfigError, match="unknown method options"):
        method("grpo", clip=0.1)
    with pytest.raises(ConfigError, match="aggregation must be one of"):
        method("grpo", aggregation="mean")
    with pytest.raises(ConfigError, match="needs norm_length"):
        aggregate(torch.ones(2), torch.tensor([0, 1]), 2, METHODS["dr_grpo"])
