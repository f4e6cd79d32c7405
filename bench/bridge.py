"""The trainer bridge, measured: the prefix tree beside a numpy floor and a naive version, and every
layout read from the store two ways on the same file, in one run, rounds interleaved so noise hits
both alike: **export** (before: each step exported, its conversation rebuilt, then its ids taken) and
**direct** (``Store.token_rows``: ids rebuilt from their stored deltas, nothing else).

(a) one GRPO group (seeded): 8 rollouts × 10 turns of one prompt, a 2k-token system prompt,
    responses of 100–600 tokens, tool outputs of 50–1500; every step of every rollout is one
    sequence, about 600k tokens. The floor is a numpy concatenate of the same tokens; the naive
    version pads each step, then builds a dict-of-dicts trie token by token (a dense T×T mask is not
    even attempted). From the store: padded steps, trajectory rows, the prefix tree.
(b) a file of 100k steps: 2,500 groups × 8 rollouts × 5 turns, short turns, recorded turn by turn
    across a group's rollouts (built once, cached in $TMPDIR/stepmill-bench-bridge/): padded steps
    (batches of 256) and trajectory rows over the whole file, the prefix tree of 100 groups.
(c) the group of (a) from `stepmill serve` to a remote trainer: what a fleet's trainer asks of a node
    (GET /v1/groups/{id}/batch, the step layout, safetensors over loopback), in tokens per second. The
    export side is the same CLI in a process whose store reads token rows through the export.

    .venv/bin/python -m bench.bridge [--rollouts 8 --turns 10 --repeat 5 --big-groups 2500 --big-repeat 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlencode

import numpy as np

from stepmill.store import StepRecord, Store
from stepmill.store.sequences import ID_DTYPE, LOGPROB_DTYPE
from stepmill.store.token_rows import TokenRow
from stepmill.trainer_bridge import step_batches, trajectory_batch, trajectory_rows, tree_batch
from stepmill.trainer_bridge.prefix_tree import pack_tree

WIDE = 1 << 20  # layout limits no step of these workloads reaches: every token is read
CACHE = Path(tempfile.gettempdir()) / "stepmill-bench-bridge"


class ThroughExport:
    """A store whose token rows are read the way the layouts read steps before ``Store.token_rows``:
    every step exported (``iter_steps``: conversation, parameters, ids from ``token_sequences``), its
    ids then taken as a row. The "before" of this bench, and the reference the tests hold it to."""

    def __init__(self, store: Store):
        self.store = store

    def token_rows(self, where=None, params=(), *, gate=True, group_id=None, trajectory_ids=None):
        for record in self.store.iter_steps(where, params, with_tokens=True, gate=gate, group_id=group_id,
                                            trajectory_ids=trajectory_ids):
            ids = record["prompt_ids"] is not None
            yield TokenRow(record["step_id"], record["trajectory_id"], record["group_id"], record["parent_step_id"],
                           record["step_index"], record["policy_version"], record["reward"],
                           record["token_provenance"],
                           np.asarray(record["prompt_ids"], ID_DTYPE) if ids else None,
                           np.asarray(record["response_ids"], ID_DTYPE) if ids else None,
                           None if record["logprobs"] is None else np.asarray(record["logprobs"], LOGPROB_DTYPE))


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
    """The same workload as captured steps in a store, each step linked to the one before it and
    continuing it token-exactly (so stored as a delta on it); the rollouts are complete, on the train
    channel."""
    rng = np.random.default_rng(0)
    store = Store(folder / "bridge.db")
    system, task = rng.integers(0, 150_000, 2000), rng.integers(0, 150_000, 200)
    with store.batch():
        for rollout in range(rollouts):
            context, parent = np.concatenate([system, task]), None
            for turn in range(turns):
                response = rng.integers(0, 150_000, rng.integers(100, 601))
                [parent] = store.record_steps([StepRecord(
                    api="control", trajectory_id=f"r{rollout}", group_id="g", step_index=turn, channel="train",
                    parent_step_id=parent,
                    messages=[{"role": "user", "content": f"turn {turn}"}] if turn == 0 else [],
                    prompt_ids=context.tolist(), response_ids=response.tolist(),
                    logprobs=(-rng.random(len(response))).tolist(), token_provenance="exact")])
                context = np.concatenate([context, response, rng.integers(0, 150_000, rng.integers(50, 1501))])
    for rollout in range(rollouts):
        store.complete_trajectory(f"r{rollout}", reward=float(rollout % 2))
    return store


def big_file(groups: int, rollouts: int = 8, turns: int = 5) -> Path:
    """``groups`` GRPO groups of short multi-turn rollouts, each turn recorded across the group's
    rollouts before the next (as concurrent rollouts arrive); built once, then reused."""
    path = CACHE / f"steps-{groups}x{rollouts}x{turns}.db"
    done = path.with_suffix(".done")
    if done.exists():
        return path
    CACHE.mkdir(exist_ok=True)
    for stale in CACHE.glob(path.name + "*"):
        stale.unlink()
    started = time.perf_counter()
    rng = np.random.default_rng(1)
    store = Store(path)
    with store.batch():
        for g in range(groups):
            prompt = rng.integers(0, 150_000, rng.integers(50, 151))
            contexts, parents = [prompt] * rollouts, [None] * rollouts
            for turn in range(turns):
                for rollout in range(rollouts):
                    response = rng.integers(0, 150_000, rng.integers(10, 61))
                    [parents[rollout]] = store.record_steps([StepRecord(
                        api="control", trajectory_id=f"g{g}-r{rollout}", group_id=f"g{g}", step_index=turn,
                        parent_step_id=parents[rollout],
                        messages=[{"role": "user", "content": f"task {g}"}] if turn == 0 else [],
                        prompt_ids=contexts[rollout].tolist(), response_ids=response.tolist(),
                        logprobs=(-rng.random(len(response))).tolist(), token_provenance="exact",
                        reward=float(rng.random()) if turn == turns - 1 else None)])
                    tool = rng.integers(0, 150_000, rng.integers(10, 61))
                    contexts[rollout] = np.concatenate([contexts[rollout], response, tool])
    store.close()
    done.write_text(f"built in {time.perf_counter() - started:.0f} s\n")
    return path


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


def export_and_direct(cases: dict, store: Store, repeat: int) -> dict[str, tuple[float, float]]:
    """Each case (name -> fn(source)) run on the export and on the store directly, alternately,
    ``repeat`` rounds: name -> (export ms, direct ms), medians."""
    sources = {"export": ThroughExport(store), "direct": store}
    times: dict = {(name, way): [] for name in cases for way in sources}
    for round_ in range(repeat):
        ways = list(sources) if round_ % 2 == 0 else list(sources)[::-1]
        for name, fn in cases.items():
            for way in ways:
                started = time.perf_counter()
                fn(sources[way])
                times[name, way].append((time.perf_counter() - started) * 1000)
    return {name: (statistics.median(times[name, "export"]), statistics.median(times[name, "direct"]))
            for name in cases}


def print_ways(title: str, tokens: int, measured: dict[str, tuple[float, float]]) -> None:
    print(f"\n{title}")
    print("| what | export | direct | tokens/s export → direct | speed-up |")
    print("|---|---|---|---|---|")
    for name, (before, after) in measured.items():
        print(f"| {name} | {before:,.0f} ms | {after:,.0f} ms | {tokens / before * 1000:,.0f} → "
              f"{tokens / after * 1000:,.0f} | {before / after:.1f}× |")


def step_tokens(store: Store, **selection) -> tuple[int, int]:
    """(steps, tokens) of the selected steps: every step's prompt + response, as the layouts read them."""
    rows = [len(row.prompt_ids) + len(row.response_ids) for row in store.token_rows(**selection) if row.has_ids]
    return len(rows), sum(rows)


def all_step_batches(source) -> None:
    for _ in step_batches(source, batch_size=256, max_prompt_length=WIDE, max_response_length=WIDE):
        pass


def all_trajectory_rows(source) -> None:
    rows, report = trajectory_rows(source)
    for start in range(0, len(rows), 256):
        trajectory_batch(rows[start:start + 256], report)


@contextmanager
def serving(db: Path, through_export: bool, token: str):
    """`stepmill serve` on ``db`` as a subprocess (its store's token rows read through the export when
    ``through_export``); yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve = ["serve", "--db", str(db), "--host", "127.0.0.1", "--port", str(port)]
    if through_export:
        command = [sys.executable, "-m", "bench.bridge", "serve-through-export", *serve]
    else:
        command = [shutil.which("stepmill", path=str(Path(sys.executable).parent)) or "stepmill", *serve]
    process = subprocess.Popen(command, env={**os.environ, "STEPMILL_TOKEN": token}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/v1/health", timeout=2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(command)} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def fetch_group(url: str, token: str, group_id: str, **layout):
    """A group's step batch as a fleet's trainer fetches it from a node (``RemoteConsumer``'s request)."""
    from stepmill.fleet.batch_wire import batch_from_bytes  # the remote client's decoder

    request = urllib.request.Request(f"{url}/v1/groups/{quote(group_id, safe='')}/batch?{urlencode(layout)}",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return batch_from_bytes(response.read())


def serve_through_export(argv: list[str]) -> None:
    """`stepmill serve` as it read steps before ``Store.token_rows``: the CLI itself, in a process whose
    stores read token rows through the export."""
    from stepmill.cli import main as cli

    Store.token_rows = lambda store, *args, **kwargs: ThroughExport(store).token_rows(*args, **kwargs)
    sys.argv = ["stepmill", *argv]
    cli()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--big-groups", type=int, default=2500, help="(b): groups of 8 rollouts × 5 turns")
    parser.add_argument("--big-repeat", type=int, default=1)
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
    print(f"(a) group: {args.rollouts} rollouts × {args.turns} turns, {len(sequences)} sequences, {tokens:,} tokens")
    print("| what | time | tokens/s | note |")
    print("|---|---|---|---|")
    print(f"| numpy concatenate (floor) | {floor_ms:.1f} ms | {tokens / floor_ms * 1000:,.0f} | |")
    print(f"| pack_tree | {tree_ms:.1f} ms ({tree_ms / floor_ms:.1f}× the floor) | {tokens / tree_ms * 1000:,.0f} | "
          f"{len(tree.input_ids):,} packed tokens, ratio {tree.token_ratio:.3f}, peak {peak / 2**20:.0f} MiB "
          f"({peak / tokens:.0f} B per token) |")
    print(f"| naive: pad each step, Python trie | {naive_ms:.0f} ms ({naive_ms / tree_ms:.0f}× pack_tree) | "
          f"{tokens / naive_ms * 1000:,.0f} | no mask at all; a dense one would be {tokens ** 2 / 2**30:,.0f} GiB |")

    folder = Path(tempfile.mkdtemp(prefix="stepmill-bridge-"))
    store = stored_group(args.rollouts, args.turns, folder)
    print_ways(f"(a) from the store, {tokens:,} tokens:", tokens, export_and_direct({
        "padded steps": lambda s: list(step_batches(s, batch_size=WIDE, max_prompt_length=WIDE)),
        "trajectory rows": lambda s: trajectory_batch(*trajectory_rows(s)),
        "prefix tree": lambda s: tree_batch(s, "g"),
    }, store, args.repeat))

    started = time.perf_counter()
    path = big_file(args.big_groups)
    big = Store(path)  # a writer: a file cached by an older stepmill is migrated
    steps, big_tokens = step_tokens(big)
    print(f"\n(b) file: {args.big_groups:,} groups × 8 rollouts × 5 turns ({steps:,} steps, {big_tokens:,} step "
          f"tokens, {path.stat().st_size / 2**20:,.0f} MiB; ready in {time.perf_counter() - started:.0f} s: "
          f"{path.with_suffix('.done').read_text().strip()})")
    tree_groups = [f"g{g}" for g in range(min(100, args.big_groups))]
    tree_tokens = sum(step_tokens(big, group_id=g)[1] for g in tree_groups)
    measured = export_and_direct({"padded steps (batches of 256)": all_step_batches,
                                  "trajectory rows (batches of 256)": all_trajectory_rows}, big, args.big_repeat)
    print_ways(f"(b) the whole file, {big_tokens:,} tokens:", big_tokens, measured)
    print_ways(f"(b) the prefix tree of {len(tree_groups)} groups, {tree_tokens:,} tokens:", tree_tokens,
               export_and_direct({"prefix tree": lambda s: [tree_batch(s, g) for g in tree_groups]},
                                 big, args.big_repeat))

    token = "bench-bridge-token"
    layout = {"max_prompt_length": WIDE, "max_response_length": WIDE}
    with serving(store.path, True, token) as before, serving(store.path, False, token) as after:
        urls = {"export": before, "direct": after}
        fetched = {way: [] for way in urls}
        for round_ in range(args.repeat):
            for way in (list(urls) if round_ % 2 == 0 else list(urls)[::-1]):
                started = time.perf_counter()
                batch = fetch_group(urls[way], token, "g", **layout)
                fetched[way].append((time.perf_counter() - started) * 1000)
                assert len(batch) == len(sequences)
    print_ways(f"(c) `stepmill serve` → a remote trainer (GET /v1/groups/g/batch, step layout), {tokens:,} tokens:",
               tokens, {"one group's batch": tuple(statistics.median(fetched[way]) for way in urls)})
    print(f"\nreproduce: .venv/bin/python -m bench.bridge --rollouts {args.rollouts} --turns {args.turns} "
          f"--repeat {args.repeat} --big-groups {args.big_groups} --big-repeat {args.big_repeat}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-through-export"]:
        serve_through_export(sys.argv[2:])
    else:
        main()
