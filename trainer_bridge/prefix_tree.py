"""Many sequences that share prefixes, packed once: a compressed trie in depth-first order.

A GRPO group (every step of every rollout) repeats its system prompt and early turns in every
sequence. Packed as a trie, each shared prefix is stored and computed once. Attention stays
exact with an O(T) encoding instead of a T×T mask: in depth-first order the descendants of a
token are a contiguous range, so query ``q`` may attend key ``k`` iff ``k <= q < subtree_end[k]``
(k is q itself or one of its ancestors).

How it is built: sequences sorted lexicographically put shared prefixes next to each other;
each one adds only its suffix after the longest prefix it shares with the one before (the
longest it shares with any), and the tokens whose subtree that suffix leaves are closed. Every
token is written once and closed once: O(T) numpy work after the sort.

Loss masks: a shared token is one packed token, but sequences may disagree on whether to train
on it. ``loss_mask`` is set where any sequence trains on the token and ``loss_count`` says how
many do; a token-level loss weighted by ``loss_count`` equals the sum of the per-sequence
losses. Exact per-sequence values come from the CSR view: sequence ``i``'s tokens are at
``seq_positions[seq_offsets[i]:seq_offsets[i+1]]``, its own mask in ``seq_loss_mask`` at the
same offsets, and the logits that predict its token ``j`` are at the packed position of token
``j - 1`` (``parent`` gives the same for every packed token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PackedTree:
    input_ids: np.ndarray  # (T,) int64, depth-first
    position_ids: np.ndarray  # (T,) each token's depth on its path = its position in every sequence holding it
    parent: np.ndarray  # (T,) packed index of the previous token on the path, -1 for a root
    subtree_end: np.ndarray  # (T,) q may attend k iff k <= q < subtree_end[k]
    loss_mask: np.ndarray  # (T,) bool: some sequence trains on this token
    loss_count: np.ndarray  # (T,) int32: how many sequences train on it
    seq_offsets: np.ndarray  # (n + 1,) CSR offsets into seq_positions / seq_loss_mask
    seq_positions: np.ndarray  # (sum of lengths,) packed index of each token of each sequence
    seq_loss_mask: np.ndarray  # (sum of lengths,) bool: each sequence's own loss mask
    original_tokens: int

    @property
    def token_ratio(self) -> float:
        """Packed tokens / original tokens (lower is better; 1.0 when nothing is shared)."""
        return len(self.input_ids) / self.original_tokens if self.original_tokens else 1.0

    def sequence(self, i: int) -> np.ndarray:
        """The packed positions of sequence i's tokens."""
        return self.seq_positions[self.seq_offsets[i]:self.seq_offsets[i + 1]]


def pack_tree(sequences, loss_masks=None) -> PackedTree:
    """Pack token-id sequences (and optional per-token loss masks) into one depth-first trie."""
    seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
    if loss_masks is None:
        masks = None
    else:
        masks = [np.asarray(m, dtype=bool).reshape(-1) for m in loss_masks]
        if len(masks) != len(seqs) or any(len(m) != len(s) for m, s in zip(masks, seqs)):
            raise ValueError("each sequence needs a loss mask of its own length")
    n = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    total = int(lengths.sum())
    # Big-endian bytes sort like the tokens, so shared prefixes sort together (4 bytes a token when ids fit).
    narrow = all(not len(s) or (s.min() >= 0 and s.max() < 2**32) for s in seqs)
    keys = [s.astype(">u4" if narrow else ">i8").tobytes() for s in seqs]
    order = sorted(range(n), key=keys.__getitem__)

    input_ids = np.empty(total, dtype=np.int64)
    position_ids = np.empty(total, dtype=np.int64)
    parent = np.empty(total, dtype=np.int64)
    subtree_end = np.empty(total, dtype=np.int64)
    seq_offsets = np.concatenate([[0], np.cumsum(lengths)])
    seq_positions = np.empty(total, dtype=np.int64)
    path = np.empty(int(lengths.max()) if n else 0, dtype=np.int64)  # packed index of each depth on the current path
    path_len, size, previous = 0, 0, None
    for i in order:
        seq = seqs[i]
        shared = 0
        if previous is not None and len(seq) and len(previous):
            m = min(len(seq), len(previous))
            differ = np.flatnonzero(seq[:m] != previous[:m])
            shared = int(differ[0]) if len(differ) else m
        shared = min(shared, path_len)
        subtree_end[path[shared:path_len]] = size  # the tokens this sequence leaves are closed here
        new = len(seq) - shared
        indices = np.arange(size, size + new)
        input_ids[size:size + new] = seq[shared:]
        position_ids[size:size + new] = np.arange(shared, len(seq))
        if new:
            parent[size] = path[shared - 1] if shared else -1
            parent[size + 1:size + new] = indices[:-1]
        path[shared:len(seq)] = indices
        path_len = len(seq)
        start = seq_offsets[i]
        seq_positions[start:start + len(seq)] = path[:len(seq)]
        size += new
        previous = seq
    subtree_end[path[:path_len]] = size
    input_ids, position_ids = input_ids[:size], position_ids[:size]
    parent, subtree_end = parent[:size], subtree_end[:size]
    if masks is None:  # every token trains: counts are how many sequences hold each token
        seq_loss_mask = np.ones(total, dtype=bool)
        loss_count = np.bincount(seq_positions, minlength=size).astype(np.int32)
    else:
        seq_loss_mask = np.concatenate(masks) if n else np.zeros(0, dtype=bool)
        loss_count = np.bincount(seq_positions[seq_loss_mask], minlength=size).astype(np.int32)
    return PackedTree(input_ids, position_ids, parent, subtree_end, loss_count > 0, loss_count, seq_offsets,
                      seq_positions, seq_loss_mask, total)


def dense_tree_mask(subtree_end: np.ndarray) -> np.ndarray:
    """The T×T boolean attention mask the O(T) encoding stands for (for tests and small T)."""
    t = len(subtree_end)
    q = np.arange(t)[:, None]
    k = np.arange(t)[None, :]
    return (k <= q) & (q < np.asarray(subtree_end)[None, :])


def flex_mask_mod(subtree_end):
    """A FlexAttention ``mask_mod`` (torch.nn.attention.flex_attention) for one packed tree."""
    import torch

    ends = torch.as_tensor(subtree_end)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    return mask_mod
