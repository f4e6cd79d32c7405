"""A step without a reward is left out of training and counted, never trained on as a reward of 0.0,
in the three layouts alike (padded steps, trajectory rows, the prefix tree).

The groups are real rollouts of a tiny random Qwen2 in a real store, claimed as a consumer hands them
out. One trajectory was never scored; another was not either, but its first step was (a step's own
reward), so that step is trained on with it and its second step is left out.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stepmill.store import StepRecord, Store  # noqa: E402
from stepmill.trainer_bridge.layouts import group_batch  # noqa: E402

from stepmill.train import forward  # noqa: E402
from stepmill.train.methods import method  # noqa: E402
from stepmill.train.micro_batches import claimed_steps, layout_batch  # noqa: E402

from .test_train_layouts import VOCAB, sample, tiny_qwen2  # noqa: E402

# per trajectory: its reward (None: never scored), or ("first step", r): only its first step has one
SCORES = {"g1": [1.0, 0.0, None, 0.5], "g2": [0.25, ("first step", 1.0), 1.0]}
LEFT_OUT = {"g1-t2": 2, "g2-t1": 1}  # steps without a reward, per trajectory (two turns each)
REWARDS = {"g1-t0": 1.0, "g1-t1": 0.0, "g1-t3": 0.5, "g2-t0": 0.25, "g2-t1": 1.0, "g2-t2": 1.0}
LAYOUTS = ("steps", "rows", "tree")


def record(store: Store, engine, generator) -> None:
    """Two turns per trajectory, the second continuing the first token-exactly (one row each)."""
    rng = np.random.default_rng(7)
    for group, scores in SCORES.items():
        for i, score in enumerate(scores):
            trajectory, prompt, steps = f"{group}-t{i}", rng.integers(3, VOCAB, 12).tolist(), []
            messages = [{"role": "user", "content": f"{trajectory} task"}]
            for turn in range(2):
                response, logprobs = sample(engine, prompt, int(rng.integers(3, 7)), generator)
                completion = {"role": "assistant", "content": f"{trajectory} answer {turn}"}
                steps.append(store.record_step(StepRecord(
                    api="openai.chat", messages=messages, completion=completion, trajectory_id=trajectory,
                    group_id=group, prompt_ids=prompt, response_ids=response, logprobs=logprobs,
                    token_provenance="exact")))
                messages = messages + [completion, {"role": "user", "content": "go on"}]
                prompt = prompt + response + rng.integers(3, VOCAB, 3).tolist()
            if isinstance(score, tuple):
                store.add_reward(steps[0], score[1])
            elif score is not None:
                store.add_reward(trajectory, score)


@pytest.fixture(scope="module")
def claimed(tmp_path_factory):
    """The groups as a consumer hands them out (``group_batch``), and the trained policy."""
    store = Store(tmp_path_factory.mktemp("unrewarded") / "steps.db")
    record(store, tiny_qwen2(seed=0, dtype=torch.float32), torch.Generator().manual_seed(0))
    batches = [group_batch(store, group) for group in SCORES]
    store.close()
    policy = tiny_qwen2(seed=1, dtype=torch.float32)
    return batches, policy


def trained(policy, batch, rl) -> tuple[forward.TokenView, dict, dict]:
    """The plan of what one step trains on, its stats and gradients."""
    policy.zero_grad(set_to_none=True)
    stats = forward.micro_batch_loss(policy, batch.chunks, batch.layout, batch.plan, rl)
    return batch.plan, stats, {n: p.grad.detach().clone() for n, p in policy.named_parameters()}


def response_tokens(batches, left_out: bool) -> int:
    """The sampled tokens of the steps with a reward (``left_out``: of those without)."""
    return sum(int(mask.sum()) for b in batches for mask, reward in zip(b.tensors["response_mask"], b.meta["reward"])
               if (reward is None) == left_out)


@pytest.mark.parametrize("micro_batch_tokens", [0, 40])
def test_a_step_without_a_reward_is_left_out_of_every_layout_alike(claimed, micro_batch_tokens):
    batches, policy = claimed
    rl = method("grpo")
    results = {}
    for layout in LAYOUTS:
        batch = layout_batch(claimed_steps(batches), layout, micro_batch_tokens)
        assert batch.unrewarded == sum(LEFT_OUT.values()), layout
        plan, stats, grads = trained(policy, batch, rl)
        rewards = dict(zip(plan.trajectory_ids, plan.rewards.tolist()))
        assert rewards == REWARDS, layout  # g1-t2 is not there as 0.0; g2-t1 has its first step's reward
        assert len(plan.seq_index) + plan.skipped == response_tokens(batches, left_out=False), layout
        results[layout] = stats, grads
    stats, grads = results["steps"]
    for layout in ("rows", "tree"):
        assert results[layout][0]["loss"] == pytest.approx(stats["loss"], abs=1e-6), layout
        for name, grad in grads.items():
            torch.testing.assert_close(results[layout][1][name], grad, atol=1e-5, rtol=1e-4, msg=f"{layout} {name}")
    assert response_tokens(batches, left_out=True) > 0


def test_read_as_zero_the_unrewarded_steps_would_change_the_step(claimed):
    """What the rule keeps from happening: the same steps with 0.0 for a missing reward train otherwise."""
    batches, policy = claimed
    as_zero = []
    for b in batches:
        meta = {**b.meta, "reward": [0.0 if r is None else r for r in b.meta["reward"]]}
        as_zero.append(type(b)(b.tensors, meta, b.report))
    rl = method("grpo")
    kept = layout_batch(claimed_steps(batches), "steps")
    zero = layout_batch(claimed_steps(as_zero), "steps")
    assert zero.unrewarded == 0
    plan, stats, _ = trained(policy, kept, rl)
    zero_plan, zero_stats, _ = trained(policy, zero, rl)
    assert len(zero_plan.trajectory_ids) == len(plan.trajectory_ids) + 1
    assert zero_stats["loss"] != pytest.approx(stats["loss"], abs=1e-6)


def test_a_batch_whose_trajectory_has_no_reward_is_refused_not_read_as_zero(claimed):
    """Read directly (verl's step batch, not through the trainer's layout_batch), a trajectory none of whose
    steps has a reward is refused by name: its token scores of 0.0 are not its reward. (And a layout the
    trainer does not know is refused, not taken for rows.)"""
    batches, policy = claimed
    with pytest.raises(forward.BadInput, match="trajectory g1-t2 has no reward"):
        forward.token_view(policy, batches[0], "steps")
    with pytest.raises(forward.BadInput, match="trajectory g1-t2 has no reward"):
        forward.token_view(policy, forward.pack_batch(batches[0]), "tree")
    with pytest.raises(forward.BadInput, match="layout must be one of"):
        layout_batch(claimed_steps(batches), "pyramid")
