"""stepmill's advantages and policy loss equal verl's (0.9.1, ``verl.trainer.ppo.core_algos``) on the
same stored group: GRPO, Dr. GRPO, RLOO, REINFORCE++ (with and without a baseline), the clipped
loss with each aggregation, and its gradients.

verl treats every row as one sample. On a group of one-step rollouts rows are trajectories and
verl reads stepmill's own step batch; on multi-turn rollouts verl gets one trajectory row per
rollout, and stepmill, on padded steps, still gives verl's numbers (its unit is the trajectory).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from omegaconf import OmegaConf  # noqa: E402  (verl's own dependency)

from stepmill.store import Store  # noqa: E402
from stepmill.trainer_bridge.layouts import group_batch, trajectory_batch, trajectory_rows  # noqa: E402

from stepmill.train.forward import token_view, view_loss  # noqa: E402
from stepmill.train.methods import advantages, method  # noqa: E402

from .test_train_layouts import record_group, tiny_qwen2  # noqa: E402

NORM = 12  # Dr. GRPO's constant: verl's loss_scale_factor

# stepmill's method -> verl's advantage estimator (name, extra arguments)
ESTIMATORS = {
    "grpo": ("grpo", {}),
    "dr_grpo": ("grpo", {"norm_adv_by_std_in_grpo": False}),
    "rloo": ("rloo", {}),
    "reinforce_pp": ("reinforce_plus_plus", {"config": OmegaConf.create({"gamma": 1.0})}),
    "reinforce_pp_baseline": ("reinforce_plus_plus_baseline", {}),
}
# stepmill's aggregation -> verl's loss_agg_mode
AGGREGATIONS = {"token": "token-mean", "sequence": "seq-mean-token-mean", "sum_norm": "seq-mean-token-sum-norm"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("verl") / "steps.db")
    engine = tiny_qwen2(seed=0)
    generator = torch.Generator().manual_seed(1)
    record_group(store, engine, "single", [1.0, 0.0, 0.0, 0.5, 1.0], generator, turns=1)
    record_group(store, engine, "multi", [0.0, 1.0, 0.25, 1.0], generator, turns=3)
    yield store
    store.close()


@pytest.fixture(scope="module")
def policy():
    model = tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + 1), dtype=p.dtype) * 0.05)
    return model


def verl_inputs(batch, view, trained_width: int):
    """verl's (rows, response length) tensors: the view's logprobs back in the rows' trained places."""
    t = batch.tensors
    mask = torch.from_numpy(t["response_mask"][:, -trained_width:]).double()
    log_prob = torch.zeros(mask.shape, dtype=view.logprobs.dtype).masked_scatter(mask.bool(), view.logprobs)
    old = torch.from_numpy(t["rollout_log_probs"][:, -trained_width:]).double()
    scores = torch.from_numpy(t["token_level_scores"][:, -trained_width:]).double()
    return log_prob, old, scores, mask, np.array(batch.meta["uid"], dtype=object)


def verl_advantages(name, scores, mask, index):
    estimator, extra = ESTIMATORS[name]
    adv, _ = core_algos.get_adv_estimator_fn(estimator)(token_level_rewards=scores.clone(), response_mask=mask,
                                                         index=index, **extra)
    return adv


def stepmill_token_advantages(view, rl):
    return advantages(view.rewards, view.groups, rl, lengths=view.lengths())[view.seq_index]


def verl_loss(log_prob, old, adv, mask, aggregation):
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                               "global_batch_info": {"loss_scale_factor": NORM}})
    return core_algos.get_policy_loss_fn("vanilla")(old, log_prob, adv, mask, AGGREGATIONS[aggregation], config)


def grads(model, value):
    model.zero_grad()
    value.backward(retain_graph=True)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_one_step_rollouts_on_stepmills_own_step_batch(store, policy):
    batch = group_batch(store, "single")
    assert len(batch) == 5
    view = token_view(policy, batch, "steps")
    log_prob, old, scores, mask, index = verl_inputs(batch, view, batch.tensors["responses"].shape[1])
    for name in ESTIMATORS:
        rl = method(name, norm_length=NORM)
        theirs = verl_advantages(name, scores, mask, index)
        ours = torch.zeros_like(mask).masked_scatter(mask.bool(), stepmill_token_advantages(view, rl))
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=name)
        for aggregation in AGGREGATIONS:
            rl = method(name, aggregation=aggregation, norm_length=NORM)
            their_loss, metrics = verl_loss(log_prob, old, theirs, mask, aggregation)
            our_loss, stats = view_loss(view, rl)
            torch.testing.assert_close(our_loss, their_loss, atol=1e-6, rtol=0, msg=f"{name} {aggregation}")
            assert stats["clip_fraction"] == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
            assert stats["clip_fraction_lower"] == pytest.approx(metrics["actor/pg_clipfrac_lower"], abs=1e-6)
            assert stats["approx_kl"] == pytest.approx(metrics["actor/ppo_kl"], abs=1e-6)
            if aggregation == "token":
                ours_g, theirs_g = grads(policy, our_loss), grads(policy, their_loss)
                for param, grad in theirs_g.items():
                    torch.testing.assert_close(ours_g[param], grad, atol=1e-8, rtol=0, msg=f"{name} {param}")


def test_multi_turn_rollouts_padded_steps_against_verl_on_trajectory_rows(store, policy):
    steps = group_batch(store, "multi")
    rows, report = trajectory_rows(store, group_id="multi")
    assert len(steps) == 12 and len(rows) == 4 and not report["new row: a step does not continue its parent token-exactly"]
    rows_batch = trajectory_batch(rows, report)
    ours_view = token_view(policy, steps, "steps")
    rows_view = token_view(policy, rows_batch, "rows")
    log_prob, old, scores, mask, index = verl_inputs(rows_batch, rows_view, rows_batch.tensors["input_ids"].shape[1])
    for name in ESTIMATORS:
        theirs = verl_advantages(name, scores, mask, index)
        for aggregation in AGGREGATIONS:
            rl = method(name, aggregation=aggregation, norm_length=NORM)
            their_loss, _ = verl_loss(log_prob, old, theirs, mask, aggregation)
            our_loss, _ = view_loss(ours_view, rl)
            torch.testing.assert_close(our_loss, their_loss, atol=1e-6, rtol=0, msg=f"{name} {aggregation}")
    # verl on the step rows would count each step as a sample of the group: other numbers
    s_log_prob, s_old, s_scores, s_mask, s_index = verl_inputs(steps, ours_view, steps.tensors["responses"].shape[1])
    per_step = verl_loss(s_log_prob, s_old, verl_advantages("grpo", s_scores, s_mask, s_index), s_mask, "sequence")[0]
    assert abs(per_step - view_loss(ours_view, method("grpo", aggregation="sequence"))[0]) > 1e-3
