"""The prefix-tree layout on a realistic GRPO group, beside a numpy floor and a naive implementation.

Workload (seeded): 8 rollouts × 10 turns of one prompt; a 2k-token system prompt; responses of
100–600 tokens and tool outputs of 50–1500; every step of every rollout is one sequence (its
prompt + response), about 600k tokens in all. The floor is a plain numpy concatenate of the same
tokens; the naive implementation is what a straightforward per-step Python version does: pad
each step, then a dict-of-dicts trie built token by token (a dense T×T mask is not even
attempted: it would need hundreds of GiB).

    .venv/bin/python -m bench.bridge [--rollouts 8 --turns 10 --repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from stepmill.store import StepRecord, Store
from stepmill.trainer_bridge import step_batches, trajectory_batch, trajectory_rows, tree_batch
from stepmill.trainer_bridge.prefix_tree import pack_tree


def group(rollouts: int, turns: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 150_000, 2000)
    task = rng.integers(0, 150_000, 200)
    sequences = []
    for _ in range(rollouts):
        context = np.concatenate([system, task])
        for _ in range(turns):
            response = rng.integers(0, 150_000, rng.integers(100, 601))
            sequences.append(np.concatenate([context, response]))
            tool = rng.integers(0, 150_000, rng.integers(50, 1501))
            context = np.concatenate([context, response, tool])
    return sequences


def stored_group(rollouts: int, turns: int, folder: Path) -> Store:
    """The same workload as captured steps in a store (a step continues its parent token-exactly)."""
    rng = np.random.default_rng(0)
    store = Store(folder / "bridge.db")
    system, task = rng.integers(0, 150_000, 2000), rng.integers(0, 150_000, 200)
    with store.batch():
        for rollout in range(rollouts):
            context = np.concatenate([system, task])
            for turn in range(turns):
                response = rng.integers(0, 150_000, rng.integers(100, 601))
                store.record_steps([StepRecord(
                    api="control", trajectory_id=f"r{rollout}", group_id="g", step_index=turn,
                    messages=[{"role": "user", "content": f"turn {turn}"}] if turn == 0 else [],
                    prompt_ids=context.tolist(), response_ids=response.tolist(),
                    logprobs=(-rng.random(len(response))).tolist(), token_provenance="exact")])
                context = np.concatenate([context, response, rng.integers(0, 150_000, rng.integers(50, 1501))])
    return store


def naive(sequences) -> int:
    """What a straightforward implementation does: pad each step to the longest, then a Python trie,
    token by token."""
    longest = max(len(s) for s in sequences)
    padded = [s.tolist() + [0] * (longest - len(s)) for s in sequences]  # the step layout, per step
    assert len(padded) == len(sequences)
    root: dict = {}
    count = 0
    for seq in sequences:
        node = root
        for token in seq.tolist():
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                count += 1
            node = child
    return count


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sequences = group(args.rollouts, args.turns)
    tokens = sum(len(s) for s in sequences)
    floor_ms, _ = timed(lambda: np.concatenate(sequences), args.repeat)
    tree_ms, tree = timed(lambda: pack_tree(sequences), args.repeat)
    tracemalloc.start()
    pack_tree(sequences)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    naive_ms, naive_nodes = timed(lambda: naive(sequences), 1)
    assert naive_nodes == len(tree.input_ids)
    print(f"group: {args.rollouts} rollouts × {args.turns} turns, {len(sequences)} sequences, {tokens:,} tokens")
    print("| what | time | tokens/s | note |")
    print("|---|---|---|---|")
    print(f"| numpy concatenate (floor) | {floor_ms:.1f} ms | {tokens / floor_ms * 1000:,.0f} | |")
    print(f"| pack_tree | {tree_ms:.1f} ms ({tree_ms / floor_ms:.1f}× the floor) | {tokens / tree_ms * 1000:,.0f} | "
          f"{len(tree.input_ids):,} packed tokens, ratio {tree.token_ratio:.3f}, peak {peak / 2**20:.0f} MiB "
          f"({peak / tokens:.0f} B per token) |")
    print(f"| naive: pad each step, Python trie | {naive_ms:.0f} ms ({naive_ms / tree_ms:.0f}× pack_tree) | "
          f"{tokens / naive_ms * 1000:,.0f} | no mask at all; a dense one would be {tokens ** 2 / 2**30:,.0f} GiB |")
    store = stored_group(args.rollouts, args.turns, Path(tempfile.mkdtemp(prefix="stepmill-bridge-")))
    step_ms, _ = timed(lambda: list(step_batches(store, batch_size=1 << 20, max_prompt_length=1 << 20)), args.repeat)
    rows_ms, _ = timed(lambda: trajectory_batch(*trajectory_rows(store)), args.repeat)
    stored_tree_ms, stored = timed(lambda: tree_batch(store, "g"), args.repeat)
    print(f"\nfrom the store (every step read back from its prefix deltas, {tokens:,} tokens):")
    print("| layout | time | tokens/s |")
    print("|---|---|---|")
    for name, ms in (("step (padded)", step_ms), ("trajectory rows", rows_ms), ("prefix tree", stored_tree_ms)):
        print(f"| {name} | {ms:.0f} ms | {tokens / ms * 1000:,.0f} |")
    print(f"\nreproduce: .venv/bin/python -m bench.bridge --rollouts {args.rollouts} --turns {args.turns} "
          f"--repeat {args.repeat}")


if __name__ == "__main__":
    main()
