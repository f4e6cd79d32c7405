"""The loss and every gradient are the same on padded steps, trajectory rows and the prefix tree.

The group is real: a tiny random Qwen2 samples multi-turn rollouts (the engine), each step's ids
and logprobs are written to a SQLite store as a white-box agent would, tool observations join the
turns token-exactly (one trajectory drifts, so its steps make two rows), and the trajectories
get different rewards. The trainer is the same model nudged off the engine's weights, so ratios
move off 1 and some are clipped.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stepmill.store import StepRecord, Store  # noqa: E402
from stepmill.trainer_bridge.layouts import step_batches, trajectory_batch, trajectory_rows, tree_batch  # noqa: E402

from stepmill.train.forward import loss, pack_batch, token_view  # noqa: E402
from stepmill.train.methods import method  # noqa: E402

VOCAB = 96
REWARDS = {"g1": [1.0, 0.0, 0.5, 1.0], "g2": [0.0, 0.25, 1.0]}


def tiny_qwen2(seed: int, attention: str = "sdpa", dtype=torch.float64):
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM._from_config(config, attn_implementation=attention).to(dtype)


def sample(model, prompt: list[int], count: int, generator) -> tuple[list[int], list[float]]:
    """The engine's turn: ``count`` tokens sampled from the model, with their logprobs."""
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(count):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            ids.append(token)
            out.append(token)
            logprobs.append(float(logp[token]))
    return out, logprobs


def record_group(store: Store, engine, group: str, rewards: list[float], generator, turns: int = 3) -> None:
    """A group of multi-turn rollouts sharing a system prompt; pairs share a task."""
    rng = np.random.default_rng(len(group) + len(rewards))
    system = rng.integers(3, VOCAB, 20).tolist()
    for i, reward in enumerate(rewards):
        trajectory = f"{group}-t{i}"
        task = np.random.default_rng(i // 2).integers(3, VOCAB, 5).tolist()
        messages = [{"role": "system", "content": f"system of {group}"}, {"role": "user", "content": f"task {i // 2}"}]
        prompt = [1] + system + [2] + task + [2]
        for turn in range(turns):
            response, logprobs = sample(engine, prompt, int(rng.integers(3, 8)), generator)
            completion = {"role": "assistant", "content": f"{trajectory} answer {turn}"}
            store.record_step(StepRecord(api="openai.chat", messages=messages, completion=completion,
                                         trajectory_id=trajectory, group_id=group, prompt_ids=prompt,
                                         response_ids=response, logprobs=logprobs, token_provenance="exact"))
            observation = rng.integers(3, VOCAB, int(rng.integers(2, 6))).tolist()
            messages = messages + [completion, {"role": "tool", "content": f"observation {turn}"}]
            prompt = prompt + response + [2] + observation + [2]
            if group == "g2" and i == 0 and turn == 0:
                prompt[len(prompt) - len(observation) - 3] = 0  # re-rendered: the next step does not continue this one
        store.add_reward(trajectory, reward)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("train") / "steps.db")
    engine = tiny_qwen2(seed=0)
    generator = torch.Generator().manual_seed(0)
    for group, rewards in REWARDS.items():
        record_group(store, engine, group, rewards, generator)
    [steps] = list(step_batches(store, batch_size=1 << 20))
    rows, report = trajectory_rows(store)
    assert report["new row: a step does not continue its parent token-exactly"] == 1
    rows_batch = trajectory_batch(rows, report)
    batches = {"steps": ("steps", steps), "rows": ("rows", rows_batch),
               "tree of steps": ("tree", pack_batch(steps)), "tree of rows": ("tree", pack_batch(rows_batch))}
    yield store, batches
    store.close()


@pytest.fixture(scope="module")
def policy():
    """The trainer: the engine's weights, nudged (the policy has moved since the rollout)."""
    model = tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.05)
    return model


def test_the_tree_of_a_step_batch_is_the_stores_tree(layouts):
    store, batches = layouts
    [g1] = list(step_batches(store, group_id="g1", batch_size=1 << 20))
    packed, expected = pack_batch(g1), tree_batch(store, "g1")[1]
    for name in ("input_ids", "position_ids", "subtree_end", "loss_count", "seq_offsets", "seq_positions"):
        assert (packed.tensors[name] == expected.tensors[name]).all(), name
    assert packed.report["token_ratio_permille"] < 600  # system prompt, tasks and earlier turns shared
    # each step extends the one before (but for the drift), so rows hold the same prefixes as steps
    rows_tree, steps_tree = batches["tree of rows"][1].tensors, batches["tree of steps"][1].tensors
    assert (rows_tree["input_ids"] == steps_tree["input_ids"]).all()


def test_every_layout_trains_on_the_same_tokens(layouts, policy):
    _, batches = layouts
    views = {name: token_view(policy, batch, layout) for name, (layout, batch) in batches.items()}
    reference = views["steps"]
    assert reference.skipped == 0 and len(reference.logprobs) == int(batches["steps"][1].tensors["response_mask"].sum())
    for name, view in views.items():
        assert sorted(view.trajectory_ids) == sorted(reference.trajectory_ids), name
        order = [view.trajectory_ids.index(t) for t in reference.trajectory_ids]
        assert view.rewards[order].tolist() == reference.rewards.tolist(), name
        assert [view.groups[k] for k in order] == reference.groups, name
        # per trajectory, the same multiset of (model logprob, engine logprob) pairs
        for k, trajectory in enumerate(reference.trajectory_ids):
            mine = view.seq_index == view.trajectory_ids.index(trajectory)
            theirs = reference.seq_index == k
            a = torch.stack([view.logprobs[mine], view.old_logprobs[mine].double()]).T.tolist()
            b = torch.stack([reference.logprobs[theirs], reference.old_logprobs[theirs].double()]).T.tolist()
            np.testing.assert_allclose(sorted(a), sorted(b), atol=1e-9, rtol=0, err_msg=f"{name} {trajectory}")


CASES = [(name, aggregation) for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
         for aggregation in ("token", "sequence")] + [("dr_grpo", "sum_norm")]


def _loss_and_grads(model, batch, layout, rl, **kwargs):
    model.zero_grad()
    value, stats = loss(model, batch, layout, rl, **kwargs)
    value.backward()
    return value.detach(), stats, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,aggregation", CASES)
def test_loss_and_gradients_agree_across_layouts(layouts, policy, name, aggregation):
    _, batches = layouts
    rl = method(name, aggregation=aggregation, norm_length=16)
    results = {label: _loss_and_grads(policy, batch, layout, rl) for label, (layout, batch) in batches.items()}
    value, stats, grads = results["steps"]
    assert value.abs() > 1e-6 and 0 < stats["clip_fraction"] < 0.9
    assert max(g.abs().max() for g in grads.values()) > 1e-4
    for label, (other, other_stats, other_grads) in results.items():
        torch.testing.assert_close(other, value, atol=1e-5, rtol=0, msg=f"loss on {label}")
        assert other_stats["clip_fraction"] == pytest.approx(stats["clip_fraction"]), label
        for param, grad in grads.items():
            torch.testing.assert_close(other_grads[param], grad, atol=1e-5, rtol=0, msg=f"{param} on {label}")


def test_kl_to_a_reference_and_entropy_agree_across_layouts(layouts, policy):
    """With eager attention (additive masks) for the reference policy."""
    _, batches = layouts
    reference = tiny_qwen2(seed=0, attention="eager")  # the engine's weights
    rl = method("grpo", aggregation="sequence", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    results = {label: _loss_and_grads(policy, batch, layout, rl, reference=reference)
               for label, (layout, batch) in batches.items()}
    value, stats, grads = results["steps"]
    assert stats["kl"] > 0 and stats["entropy"] > 0
    for label, (other, other_stats, other_grads) in results.items():
        torch.testing.assert_close(other, value, atol=1e-5, rtol=0, msg=label)
        assert other_stats["kl"] == pytest.approx(stats["kl"]) and other_stats["entropy"] == pytest.approx(stats["entropy"])
        for param, grad in grads.items():
            torch.testing.assert_close(other_grads[param], grad, atol=1e-5, rtol=0, msg=f"{param} on {label}")


def test_flex_attention_on_the_tree(layouts):
    """FlexAttention with the tree's mask_mod gives the padded steps' logprobs (forward only on the
    CPU, where torch has no FlexAttention backward; float32, what its CPU kernel takes)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    _, batches = layouts
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flex = tiny_qwen2(seed=0, attention="flex_attention", dtype=torch.float32).to(device)
    padded = tiny_qwen2(seed=0, attention="sdpa", dtype=torch.float32).to(device)
    steps, tree = batches["steps"][1], batches["tree of steps"][1]
    rl = method("grpo")
    with torch.no_grad():
        expected, _ = loss(padded, steps, "steps", rl)
        view = token_view(flex, tree, "tree", attention="flex")
        reference = token_view(padded, steps, "steps")
    got, _ = loss(flex, tree, "tree", rl) if device == "cuda" else (None, None)
    if got is not None:
        got.backward()
        torch.testing.assert_close(got.detach(), expected, atol=1e-4, rtol=0)
    for trajectory in reference.trajectory_ids:
        mine = view.logprobs[view.seq_index == view.trajectory_ids.index(trajectory)].sort().values
        theirs = reference.logprobs[reference.seq_index == reference.trajectory_ids.index(trajectory)].sort().values
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
