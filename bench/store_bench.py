"""Does recording a step stay flat as the file grows? Measured, with a naive lookup beside it.

Workload: GRPO-style traffic, untagged (linking by conversation only): groups of 8 rollouts of
one of 50 prompts, 6 turns each, where every rollout's first turn is identical (greedy sampling,
a fixed first tool call) — so thousands of steps share each prefix key. At each size the cost of
`record_step` for one more turn is timed (p50/p99 of 200), and beside it the lookup the store used
before (fetch every step with a matching key, pick in Python).

    .venv/bin/python -m bench.store_bench                # up to 100k steps, a few minutes
    .venv/bin/python -m bench.store_bench --sizes 1000,10000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from stepmill.store import StepRecord, Store
from stepmill.protocols import messages as linking

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 40}


def rollout_turns(prompt: int, rollout: int, turns: int):
    """(messages, completion) of each turn of one rollout."""
    messages = [SYSTEM, {"role": "user", "content": f"Task {prompt}: make the tests pass."}]
    for turn in range(turns):
        if turn == 0:
            completion = {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]}
        else:
            completion = {"role": "assistant", "content": f"step {turn} of rollout {rollout}: " + "edit " * 30}
        yield list(messages), completion
        messages += [completion, {"role": "tool", "tool_call_id": "call_0", "content": f"output {rollout}.{turn} " * 20}
                     if turn == 0 else {"role": "user", "content": f"continue {turn}"}]


def fill(store: Store, target: int, state: dict) -> None:
    with store.batch():
        while state["steps"] < target:
            group = state["groups"]
            for rollout in range(8):
                for messages, completion in rollout_turns(group % 50, group * 8 + rollout, 6):
                    store.record_steps([StepRecord(api="openai.chat", messages=messages, completion=completion)])
                    state["steps"] += 1
            state["groups"] += 1


def naive_lookup(store: Store, messages: list) -> None:
    """The old way: every step whose key matches any prefix, scanned in Python."""
    keys = linking.rolling_keys(messages)
    marks = ",".join("?" * len(keys))
    best = None
    for row in store.db.conn.execute(f"SELECT id, trajectory_id, continuation_key FROM steps "
                                     f"WHERE continuation_key IN ({marks}) ORDER BY started_at DESC", keys):
        best = best or row


def measure(store: Store, state: dict) -> tuple[list[float], list[float]]:
    record, naive = [], []
    for i in range(200):
        group = state["groups"]
        turns = list(rollout_turns(group % 50, group * 8, 6))
        messages, completion = turns[1 + i % 5]
        started = time.perf_counter()
        naive_lookup(store, messages)
        naive.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        store.record_step(StepRecord(api="openai.chat", messages=messages, completion=completion))
        record.append((time.perf_counter() - started) * 1000)
        state["steps"] += 1
    return record, naive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000")
    args = parser.parse_args()
    store = Store(Path(tempfile.mkdtemp(prefix="stepmill-store-bench-")) / "bench.db")
    state = {"steps": 0, "groups": 0}
    print("| steps in the file | record_step p50 ms | p99 ms | naive lookup alone p50 ms |")
    print("|---|---|---|---|")
    first = None
    for size in (int(s) for s in args.sizes.split(",")):
        fill(store, size, state)
        record, naive = measure(store, state)
        p50 = statistics.median(record)
        first = first or p50
        print(f"| {size:,} | {p50:.2f} ({p50 / first:.2f}x) | {sorted(record)[197]:.2f} | {statistics.median(naive):.2f} |",
              flush=True)
    print("\nreproduce: .venv/bin/python -m bench.store_bench --sizes " + args.sizes)


if __name__ == "__main__":
    main()
