"""The per-version numbers the trainer reads from the groups it claims (stepmill.train.signals): the mean
reward of the rewarded trajectories, and the share of flat groups, whose rewards are all equal, so a
group-relative method learns nothing from them (greedy rollouts are the usual cause).

The groups are real steps in a real store, claimed as a consumer hands them out (``group_batch``)."""

from __future__ import annotations

import pytest

from stepmill.store import StepRecord, Store
from stepmill.train.signals import flat_groups, mean_reward
from stepmill.trainer_bridge.layouts import group_batch

# per group, each trajectory's reward (None: never scored)
GROUPS = {"flat": [0.5, 0.5, 0.5, 0.5], "spread": [0.0, 1.0, 0.25, 0.25],
          "flat-but-one-unscored": [1.0, None, 1.0], "one-scored": [0.75, None]}


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("signals") / "steps.db")
    for group, rewards in GROUPS.items():
        for i, reward in enumerate(rewards):
            trajectory = f"{group}-{i}"
            store.record_step(StepRecord(
                api="openai.chat", messages=[{"role": "user", "content": f"{trajectory} task"}],
                completion={"role": "assistant", "content": "words"}, trajectory_id=trajectory, group_id=group,
                prompt_ids=[5, 6, 7], response_ids=[8 + i, 9], logprobs=[-0.5, -0.25], token_provenance="exact"))
            if reward is not None:
                store.add_reward(trajectory, reward)
    claimed = {group: group_batch(store, group) for group in GROUPS}
    store.close()
    return claimed


def test_a_group_whose_rewards_are_all_equal_is_flat(batches):
    assert flat_groups([batches["flat"]]) == 1.0
    assert flat_groups([batches["spread"]]) == 0.0
    # an unscored trajectory is not a reward of 0.0: the two scored ones are equal
    assert flat_groups([batches["flat-but-one-unscored"]]) == 1.0


def test_the_share_counts_only_groups_with_two_rewards_to_compare(batches):
    assert flat_groups([batches["one-scored"]]) is None
    assert flat_groups(list(batches.values())) == pytest.approx(2 / 3)
    assert flat_groups([]) is None


def test_the_mean_reward_leaves_an_unscored_trajectory_out(batches):
    rewarded = [r for rewards in GROUPS.values() for r in rewards if r is not None]
    assert mean_reward(list(batches.values())) == pytest.approx(sum(rewarded) / len(rewarded))
    assert mean_reward([batches["one-scored"]]) == 0.75
