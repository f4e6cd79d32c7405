"""Do the dashboard's pages stay fast on a large file? Each page timed against Datasette's own table page.

Fills a database through the Store API (batches of steps): GRPO-style groups of 8 rollouts of 6
turns with exact token ids, a shared system prompt, tool calls and results, two agents, three policy
versions, rewards, some reviews, runner registrations, spread over the last ~40 hours so the live
window holds a realistic tail. Then starts `stepmill ui` on it and times each page over HTTP, signed in.

    .venv/bin/python -m bench.ui_bench                       # 100k steps (a few minutes to fill)
    .venv/bin/python -m bench.ui_bench --steps 10000 --db /tmp/ui10k.db
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stepmill.store import StepRecord, Store
from stepmill.ui.datasette_plugin import stepmill_path

ROLLOUTS, TURNS = 8, 6
SYSTEM = {"role": "system", "content": "You are a coding agent. " * 40}
SYSTEM_IDS = list(range(1000, 1200))
AGENTS = ("tool-loop", "token-loop")


def _turns(group: int, rollout: int, rng: random.Random):
    """(messages, completion, prompt ids, response ids) of each turn of one rollout."""
    messages = [SYSTEM, {"role": "user", "content": f"Task {group}: make the tests pass."}]
    ids = SYSTEM_IDS + [2000 + group % 500, 7, 8]
    for turn in range(TURNS):
        call = f"call_{group}_{rollout}_{turn}"
        if turn < TURNS - 1:
            completion = {"role": "assistant", "content": "", "tool_calls": [
                {"id": call, "type": "function", "function": {"name": "run", "arguments": json.dumps({"n": turn})}}]}
        else:
            completion = {"role": "assistant", "content": f"done after {turn} tools, rollout {rollout}"}
        # greedy first turn: every rollout of the group shares it; later turns diverge
        response = [3000 + turn] * 10 if turn == 0 else [rng.randrange(5000, 60000) for _ in range(30)]
        yield list(messages), completion, list(ids), response
        result = {"role": "tool", "tool_call_id": call, "content": f"output {rollout}.{turn} " * 20}
        messages += [completion, result]
        ids += response + [rng.randrange(5000, 60000) for _ in range(20)]


def fill(store: Store, steps: int, *, batch_groups: int = 20) -> dict:
    rng = random.Random(7)
    groups = max(1, steps // (ROLLOUTS * TURNS))
    now = _dt.datetime.now(_dt.UTC)
    start = now - _dt.timedelta(seconds=1.5 * groups * ROLLOUTS * TURNS)
    clock = [0]

    def stamp() -> str:
        clock[0] += 1
        return (start + _dt.timedelta(seconds=1.5 * clock[0])).isoformat(timespec="milliseconds")

    for first in range(0, groups, batch_groups):
        runs = []
        with store.batch():
            for group in range(first, min(groups, first + batch_groups)):
                agent = AGENTS[group % 2]
                for rollout in range(ROLLOUTS):
                    trajectory = f"bench-g{group}-{agent}-{rollout}"
                    parent = None
                    for messages, completion, prompt, response in _turns(group, rollout, rng):
                        parent = store.record_steps([StepRecord(
                            api="openai.chat", model="qwen", trajectory_id=trajectory, group_id=f"bench-g{group}",
                            parent_step_id=parent, messages=messages, completion=completion, prompt_ids=prompt,
                            response_ids=response, token_provenance="exact", started_at=stamp(),
                            policy_version=str(1 + 3 * group // groups), usage={"input_tokens": len(prompt),
                                                                                 "output_tokens": len(response)},
                            headers={"user-agent": "OpenAI/Python 2.0" if agent == "tool-loop" else "stepmill"})])[0]
                    runs.append((trajectory, agent, group))
        with store.write() as conn:  # what the runner and the reward pass add per run
            for trajectory, agent, group in runs:
                done = (start + _dt.timedelta(seconds=1.5 * clock[0])).isoformat(timespec="milliseconds")
                outcome = "ok" if rng.random() > 0.05 else "failed"
                conn.execute("UPDATE trajectories SET metadata = ?, status = 'complete', completed_at = ? WHERE id = ?",
                             [json.dumps({"agent": agent, "outcome": outcome, "exit_status": 0}), done, trajectory])
                conn.execute("INSERT INTO run_credentials (trajectory_id, group_id, channel, secret_hash, created_at) "
                             "VALUES (?, ?, 'train', 'x', ?)", [trajectory, f"bench-g{group}", done])
            store_rewards(conn, runs, rng)
    return {"groups": groups, "steps": store.query("SELECT count(*) AS n FROM steps")[0]["n"]}


def store_rewards(conn, runs, rng) -> None:
    from stepmill.store import curation
    from stepmill.store.ids import now_iso

    for trajectory, _, group in runs:
        curation.add_reward(conn, "trajectory", trajectory, float(rng.random() < 0.5), source="rule", name="bench",
                            created_at=now_iso())
        if rng.random() < 0.1:
            curation.add_review(conn, "trajectory", trajectory, "label", "bad", reviewer="bench", created_at=now_iso())


def time_pages(db: Path, pages: list[tuple[str, str]], repeat: int) -> list[tuple[str, str, float, float, float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.browser import (
        UI,  # `stepmill ui` for real, signed in through the link it prints
    )

    rows = []
    with UI(db) as ui:
        for name, path in pages:
            times = []
            for _ in range(repeat + 1):
                started = time.perf_counter()
                status, body, _ = ui.get(path)
                times.append((time.perf_counter() - started) * 1000)
                assert status == 200, (path, status, body[:300])
            rows.append((name, path, times[0], statistics.median(times[1:]), max(times[1:])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--db", help="reuse (or create) this file; default: a fresh temporary one")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp(prefix="stepmill-ui-bench-")) / "bench.db"
    store = Store(str(db))
    have = store.query("SELECT count(*) AS n FROM steps")[0]["n"]
    if have < args.steps:
        started = time.perf_counter()
        filled = fill(store, args.steps - have)
        print(f"filled {db}: {filled['steps']:,} steps in {time.perf_counter() - started:.0f} s", flush=True)
    name = db.stem
    group = store.query("SELECT group_id FROM trajectories ORDER BY created_at DESC LIMIT 1")[0]["group_id"]
    trajectory = store.query("SELECT id FROM trajectories WHERE group_id = ? LIMIT 1", [group])[0]["id"]
    step = store.query("SELECT id FROM steps WHERE trajectory_id = ? ORDER BY step_index DESC LIMIT 1",
                       [trajectory])[0]["id"]
    steps = store.query("SELECT count(*) AS n FROM steps")[0]["n"]
    store.close()
    pages = [
        ("baseline: Datasette table page (steps)", f"/{name}/steps"),
        ("baseline: Datasette table page (trajectories)", f"/{name}/trajectories"),
        ("live page (HTML)", "/-/stepmill/live"),
        ("live refresh (live.json, 30 min)", "/-/stepmill/live.json"),
        ("live refresh (live.json, 24 h)", "/-/stepmill/live.json?minutes=1440"),
        ("lifecycle + charts (HTML)", "/-/stepmill/lifecycle"),
        ("group page (HTML)", stepmill_path("groups", group)),
        ("group page (JSON)", stepmill_path("groups", group, ".json")),
        ("trajectory page (tool results paired)", stepmill_path("trajectories", trajectory)),
        ("step page", stepmill_path("steps", step)),
    ]
    rows = time_pages(db, pages, args.repeat)
    base = rows[0][3]
    print(f"\n{steps:,} steps in {db}; each page fetched once cold, then {args.repeat} times\n")
    print("| page | first ms | median ms | max ms | × Datasette's table page |")
    print("|---|---|---|---|---|")
    for label, _, first, median, worst in rows:
        print(f"| {label} | {first:.0f} | {median:.0f} | {worst:.0f} | {median / base:.2f} |")
    print(f"\nreproduce: .venv/bin/python -m bench.ui_bench --steps {args.steps} --db {db}")


if __name__ == "__main__":
    main()
