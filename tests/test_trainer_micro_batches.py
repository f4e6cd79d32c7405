"""The trainer on hardware-sized batches: micro-batches with gradient accumulation give one batch's
loss and gradients, and logprobs made from the hidden states in chunks, only where a trained token is
predicted, equal those of the full logits while the largest vocabulary-wide tensor shrinks to the
trained tokens (counted by a dispatch mode that sees every tensor torch makes).

The groups are those of ``test_train_layouts`` (a tiny random Qwen2 sampled multi-turn rollouts into
a real store); the trainer is its nudged policy, in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from stepmill.trainer_bridge.layouts import step_batches  # noqa: E402

from stepmill.train import forward  # noqa: E402
from stepmill.train.methods import method  # noqa: E402
from stepmill.train.micro_batches import claimed_steps, layout_batch  # noqa: E402

from .test_train_layouts import VOCAB, REWARDS, layouts, tiny_qwen2  # noqa: E402,F401  (layouts: the fixture)


@pytest.fixture(scope="module")
def policy32():
    model = tiny_qwen2(seed=0, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model


def claimed(store) -> list:
    """The groups as a consumer hands them out: one step batch per group, its ``group_id`` beside it."""
    batches = []
    for group in REWARDS:
        for batch in step_batches(store, group_id=group, batch_size=1 << 20):
            batch.meta["group_id"] = group
            batches.append(batch)
    return batches


def accumulated(model, batch, rl) -> tuple[dict, dict]:
    model.zero_grad(set_to_none=True)
    stats = forward.micro_batch_loss(model, batch.chunks, batch.layout, batch.plan, rl)
    return stats, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["steps", "rows", "tree"])
@pytest.mark.parametrize("name,aggregation", [("grpo", "token"), ("rloo", "sequence"), ("dr_grpo", "sum_norm"),
                                              ("reinforce_pp", "token")])
def test_micro_batches_give_one_batchs_loss_and_gradients(layouts, policy32, layout, name, aggregation):
    store, _ = layouts
    rl = method(name, aggregation=aggregation, norm_length=16, kl_coef=0.0)
    whole_stats, whole = accumulated(policy32, layout_batch(claimed_steps(claimed(store)), layout, 0), rl)
    split = layout_batch(claimed_steps(claimed(store)), layout, 60)  # rows of 30-70 tokens: about one row a micro-batch
    assert len(split.chunks) >= 5
    stats, grads = accumulated(policy32, split, rl)
    assert abs(whole_stats["loss"]) > 1e-4 and max(g.abs().max() for g in whole.values()) > 1e-4
    assert stats["loss"] == pytest.approx(whole_stats["loss"], abs=1e-5)
    assert stats["tokens"] == whole_stats["tokens"] and stats["clip_fraction"] == pytest.approx(whole_stats["clip_fraction"])
    for param, grad in whole.items():
        torch.testing.assert_close(grads[param], grad, atol=1e-5, rtol=0, msg=f"{param} on {layout}")


def test_micro_batches_agree_with_the_one_batch_loss_of_every_layout(layouts, policy32):
    """The accumulated loss is the loss ``forward.loss`` gives on the whole batch (its own aggregation)."""
    store, batches = layouts
    rl = method("grpo", aggregation="sequence")
    expected, _ = forward.loss(policy32, batches["steps"][1], "steps", rl)
    stats, _ = accumulated(policy32, layout_batch(claimed_steps(claimed(store)), "tree", 100), rl)
    assert stats["loss"] == pytest.approx(float(expected.detach()), abs=1e-5)


class LargestVocabularyTensor(TorchDispatchMode):
    """The largest tensor with a last dimension of the vocabulary's size that any torch op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == VOCAB:
                self.largest = max(self.largest, tensor.numel())
        return out


def full_logprobs(model, batch, layout) -> tuple[torch.Tensor, int]:
    """The trained tokens' logprobs from the model's full [B, T, V] logits, in the view's order."""
    t = batch.tensors
    plan = forward.token_view(None, batch, layout)
    if layout == "tree":
        mask = forward.tree_attention_mask(model, t["subtree_end"])
        logits = model(input_ids=torch.from_numpy(t["input_ids"])[None], attention_mask=mask,
                       position_ids=torch.from_numpy(t["position_ids"])[None]).logits[0]
        offsets, positions = t["seq_offsets"], t["seq_positions"]
        trained = [(positions[i - 1], positions[i]) for s in range(len(offsets) - 1)
                   for i in range(offsets[s] + 1, offsets[s + 1]) if t["seq_loss_mask"][i]]
        rows = [logits[a] for a, _ in trained]
        targets = [int(t["input_ids"][b]) for _, b in trained]
    else:
        mask = forward.padded_attention_mask(model, torch.from_numpy(t["attention_mask"]))
        logits = model(input_ids=torch.from_numpy(t["input_ids"]), attention_mask=mask,
                       position_ids=torch.from_numpy(t["position_ids"])).logits
        trained, _ = forward._full_width(batch)
        r, c = np.nonzero(trained & (t["position_ids"] > 0))
        rows = [logits[i, j - 1] for i, j in zip(r, c)]
        targets = [int(t["input_ids"][i, j]) for i, j in zip(r, c)]
    logp = torch.log_softmax(torch.stack(rows), -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
    assert len(logp) == len(plan.old_logprobs)
    return logp, logits.numel()


@pytest.mark.parametrize("label", ["steps", "rows", "tree of steps", "tree of rows"])
def test_chunked_logprobs_equal_the_full_ones_and_never_hold_the_prompts_logits(layouts, policy32, label):
    _, batches = layouts
    layout, batch = batches[label]
    with torch.no_grad():
        expected, full_size = full_logprobs(policy32, batch, layout)
        counter = LargestVocabularyTensor()
        with counter:
            view = forward.token_view(policy32, batch, layout, entropy=True)
    torch.testing.assert_close(view.logprobs, expected, atol=1e-6, rtol=0)
    trained = len(view.logprobs)
    assert counter.largest <= trained * VOCAB < full_size  # the trained tokens' rows, not every position's


def test_a_chunk_boundary_changes_nothing(layouts):
    """The lm_head and log-softmax in chunks of 7 positions (with gradients, checkpointed) give the
    logprobs, entropies and gradients of one chunk (in float64: a float32 gradient summed over a
    thousand positions in another order differs by its rounding, 3e-4 here)."""
    _, batches = layouts
    policy64 = tiny_qwen2(seed=1)
    batch = batches["steps"][1]
    t = batch.tensors
    hidden = forward._hidden_states(policy64, input_ids=torch.from_numpy(t["input_ids"][:, 1:]))
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = torch.from_numpy(t["input_ids"][:, 2:]).reshape(-1)[: len(hidden)]
    hidden = hidden[: len(targets)]
    results = []
    for chunk in (7, len(hidden)):
        policy64.zero_grad(set_to_none=True)
        logp, ent = forward._logprobs_from_hidden(policy64, hidden, targets, True, chunk=chunk)
        (logp.sum() + ent.sum()).backward(retain_graph=True)
        results.append((logp.detach(), ent.detach(), policy64.lm_head.weight.grad.clone()))
    for got, want in zip(results[0], results[1]):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
