"""The policy's check of the engine's logprobs against the weights of each step's stamped version: it
finds a wrong stamp, and it leaves the weights being trained as they were."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytestmark = pytest.mark.torch


def _step_batch(prompt: list[int], response: list[int], logprobs: list[float], version: str):
    from stepmill.trainer_bridge.layouts import Batch

    p, r = len(prompt), len(response)
    tensors = {"prompts": np.array([prompt]), "responses": np.array([response]),
               "input_ids": np.array([prompt + response]), "attention_mask": np.ones((1, p + r), np.int64),
               "position_ids": np.arange(p + r)[None], "response_mask": np.ones((1, r), np.int64),
               "rollout_log_probs": np.array([logprobs], np.float32), "token_level_scores": np.zeros((1, r), np.float32)}
    meta = {"uid": ["g"], "trajectory_id": ["t"], "step_id": ["s"], "step_index": [0], "parent_step_id": [None],
            "policy_version": [version], "reward": [None]}  # unscored: its tokens are checked all the same
    return Batch(tensors, meta, Counter())


def test_a_stale_step_is_checked_against_its_own_versions_weights_and_training_goes_on_from_the_newest(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stepmill.train.config import TrainConfig
    from stepmill.train.forward import sampled_logprobs
    from stepmill.train.micro_batches import claimed_steps
    from stepmill.train.policy import Policy

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    policy = Policy(TrainConfig(model=str(tmp_path / "m"), mode="async", max_staleness=1))
    policy.serving(0)
    prompt, response = [1, 2, 3], [4, 5, 6, 7]
    with torch.no_grad():  # what the engine reported serving version 0
        engine = sampled_logprobs(policy.model, _step_batch(prompt, response, [0.0] * 4, "0"))[0].tolist()
        for p in policy.model.parameters():  # an optimizer step: version 1
            p.add_(0.05 * torch.randn_like(p))
    policy.serving(1)
    newest = {k: v.clone() for k, v in policy.model.state_dict().items()}

    assert policy.sample_gap(claimed_steps([_step_batch(prompt, response, engine, "0")]))["rollout_gap"] < 1e-6
    assert all(torch.equal(v, newest[k]) for k, v in policy.model.state_dict().items())
    # the same tokens stamped with version 1 are a wrong stamp: the engine served version 0's weights
    assert policy.sample_gap(claimed_steps([_step_batch(prompt, response, engine, "1")]))["rollout_gap"] > 1e-3
    # a version no longer kept is counted, not compared
    assert policy.sample_gap(claimed_steps([_step_batch(prompt, response, engine, "-5")]))["rollout_gap_unchecked"] == 1
