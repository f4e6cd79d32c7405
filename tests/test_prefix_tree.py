"""pack_tree: every sequence is recovered, the O(T) mask equals tree attention, and a reference
attention model computes the same outputs over the packed tree as over each sequence alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.trainer_bridge.prefix_tree import dense_tree_mask, pack_tree

GROUPS = st.lists(st.lists(st.integers(min_value=0, max_value=3), max_size=12), min_size=1, max_size=8).flatmap(
    # add copies and prefixes of drawn sequences: identical rollouts, one a prefix of another, empty suffixes
    lambda seqs: st.lists(st.sampled_from(seqs).flatmap(lambda s: st.integers(0, len(s)).map(lambda k: s[:k])),
                          max_size=4).map(lambda extra: seqs + extra))


def ancestors_mask(tree) -> np.ndarray:
    """Tree attention from its definition: each token sees itself and its ancestors."""
    t = len(tree.input_ids)
    mask = np.zeros((t, t), dtype=bool)
    for q in range(t):
        k = q
        while k >= 0:
            mask[q, k] = True
            k = tree.parent[k]
    return mask


@settings(max_examples=300, deadline=None)
@given(sequences=GROUPS, data=st.data())
def test_random_groups_against_the_definition(sequences, data):
    masks = [data.draw(st.lists(st.booleans(), min_size=len(s), max_size=len(s))) for s in sequences]
    tree = pack_tree(sequences, masks)
    for i, seq in enumerate(sequences):
        positions = tree.sequence(i)
        assert tree.input_ids[positions].tolist() == seq
        assert tree.position_ids[positions].tolist() == list(range(len(seq)))
        if len(seq) > 1:
            assert tree.parent[positions[1:]].tolist() == positions[:-1].tolist()
        if seq:
            assert tree.parent[positions[0]] == -1
    assert (dense_tree_mask(tree.subtree_end) == ancestors_mask(tree)).all()
    distinct_prefixes = {tuple(s[:k]) for s in sequences for k in range(1, len(s) + 1)}
    assert len(tree.input_ids) == len(distinct_prefixes), "each shared prefix once"
    expected = np.zeros(len(tree.input_ids), dtype=int)
    for i, mask in enumerate(masks):
        np.add.at(expected, tree.sequence(i)[np.asarray(mask, dtype=bool)], 1)
    assert tree.loss_count.tolist() == expected.tolist() and (tree.loss_mask == (expected > 0)).all()


def test_empty_and_identical():
    tree = pack_tree([[], [5, 6], [5, 6], []])
    assert tree.input_ids.tolist() == [5, 6] and tree.token_ratio == 0.5
    assert pack_tree([]).input_ids.tolist() == []


# -- a reference attention model (numpy, float64): embeddings, rotary positions, causal layers -----------
class Reference:
    def __init__(self, vocab=64, dim=32, layers=3, heads=4, seed=0):
        rng = np.random.default_rng(seed)
        self.heads, self.dim = heads, dim
        self.embed = rng.normal(0, 1, (vocab, dim))
        self.layers = [{name: rng.normal(0, dim ** -0.5, (dim, dim)) for name in ("q", "k", "v", "o", "up", "down")}
                       for _ in range(layers)]

    def rotary(self, x, positions):
        half = x.shape[-1] // 2
        freqs = 1.0 / (10000 ** (np.arange(half) / half))
        angles = positions[:, None] * freqs[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def __call__(self, ids, positions, mask):
        x = self.embed[ids]
        t, hd = len(ids), self.dim // self.heads
        for w in self.layers:
            q = self.rotary((x @ w["q"]).reshape(t, self.heads, hd), positions)
            k = self.rotary((x @ w["k"]).reshape(t, self.heads, hd), positions)
            v = (x @ w["v"]).reshape(t, self.heads, hd)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
            scores = np.where(mask[None], scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            x = x + np.einsum("hqk,khd->qhd", weights, v).reshape(t, self.dim) @ w["o"]
            x = x + np.tanh(x @ w["up"]) @ w["down"]
        return x


def test_reference_attention_is_the_same_packed_and_alone():
    rng = np.random.default_rng(1)
    system = rng.integers(0, 64, 30).tolist()
    group = []
    for rollout in range(4):  # rollouts sharing a system prompt, some turns shared, some not
        turn1 = system + [1, 2, 3] + rng.integers(0, 64, 6).tolist()
        group += [turn1, turn1 + rng.integers(0, 64, 5).tolist()]
    group.append(group[0][:20])  # a prefix of another
    tree = pack_tree(group)
    assert tree.token_ratio < 0.5
    model = Reference()
    packed = model(tree.input_ids, tree.position_ids.astype(float), dense_tree_mask(tree.subtree_end))
    for i, seq in enumerate(group):
        alone = model(np.array(seq), np.arange(len(seq), dtype=float), np.tril(np.ones((len(seq), len(seq)), bool)))
        np.testing.assert_allclose(packed[tree.sequence(i)], alone, atol=1e-6, rtol=0)


def test_a_tiny_hugging_face_model_gives_the_same_logits():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().double()
    group = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9]]
    tree = pack_tree(group)
    mask = torch.from_numpy(dense_tree_mask(tree.subtree_end))
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))[None, None]
    with torch.no_grad():
        packed = model(input_ids=torch.from_numpy(tree.input_ids)[None],
                       position_ids=torch.from_numpy(tree.position_ids)[None], attention_mask=additive).logits[0]
        for i, seq in enumerate(group):
            alone = model(input_ids=torch.tensor([seq])).logits[0]
            torch.testing.assert_close(packed[torch.from_numpy(tree.sequence(i))], alone, atol=1e-6, rtol=0)


def test_flex_attention_mask_mod_matches_the_dense_mask():
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from stepmill.trainer_bridge.prefix_tree import flex_mask_mod

    tree = pack_tree([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9], [1, 2, 3, 4, 5, 1, 1, 1, 1, 1, 1, 1], [7] * 6])
    t = len(tree.input_ids)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 16, dtype=torch.float64) for _ in range(3))
    block_mask = flex.create_block_mask(flex_mask_mod(tree.subtree_end), 1, 1, t, t, device="cpu")
    out = flex.flex_attention(q, k, v, block_mask=block_mask)
    dense = torch.from_numpy(dense_tree_mask(tree.subtree_end))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_batches_are_torch_tensors_without_a_copy():
    torch = pytest.importorskip("torch")
    from stepmill.trainer_bridge.layouts import Batch

    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    tensors = Batch({"input_ids": array}, {"step_id": ["a", "b"]}).to_torch()
    array[0, 0] = 42
    assert tensors["input_ids"][0, 0].item() == 42 and tensors["input_ids"].dtype == torch.int64
