"""What the dashboard pages show: live runs, charts, and one group's rollouts with their prefix tree.

``live`` is one SQL statement over a recent window, every part of it read through an index
(run_credentials.created_at, trajectories.completed_at, steps.started_at), so a refresh costs
the same whatever the file's size. ``group`` packs a group's steps with the bridge's own
``pack_tree`` and cuts the packed trie into the segments the page draws.
"""

from __future__ import annotations

import datetime as _dt
import threading
from collections import defaultdict

import numpy as np

from stepmill.store import curation
from stepmill.store.db import Store, loads

# An open run is starting until its first step is recorded (it may wait for a slot), then running.
_OPEN_STATE = ("CASE WHEN json_extract(r.metadata, '$.outcome') IS NOT NULL THEN 'finishing' WHEN EXISTS "
               "(SELECT 1 FROM steps s WHERE s.trajectory_id = r.id) THEN 'running' ELSE 'starting' END")
_RUN_STATE = (f"CASE WHEN r.status = 'open' THEN {_OPEN_STATE} "
              "ELSE coalesce(json_extract(r.metadata, '$.outcome'), 'complete') END")
# Rows: kind, agent, model, policy_version, bucket, n, tokens, trajectory. ``recent``: runs registered or
# finished in the window (a rerun registers again, so it counts as running from its new start).
LIVE = f"""
WITH recent AS (
  SELECT t.* FROM run_credentials c JOIN trajectories t ON t.id = c.trajectory_id WHERE c.created_at >= :since
  UNION SELECT t.* FROM trajectories t WHERE t.completed_at >= :since)
SELECT 'runs', json_extract(r.metadata, '$.agent'), NULL, r.policy_version, {_RUN_STATE}, count(*), 0, NULL
  FROM recent r WHERE json_extract(r.metadata, '$.agent') IS NOT NULL GROUP BY 2, 4, 5
UNION ALL SELECT * FROM (
  SELECT 'running', json_extract(r.metadata, '$.agent'), {_OPEN_STATE}, r.policy_version, r.created_at, 1, 0, r.id
  FROM recent r WHERE r.status = 'open' AND json_extract(r.metadata, '$.agent') IS NOT NULL
  AND json_extract(r.metadata, '$.outcome') IS NULL ORDER BY r.created_at DESC LIMIT 20)
UNION ALL
SELECT iif(s.started_at >= :minute_ago, 'last', 'steps'), json_extract(t.metadata, '$.agent'), s.model,
  s.policy_version, substr(s.started_at, 1, 16), count(*),
  sum(coalesce(s.input_tokens, 0) + coalesce(s.output_tokens, 0)), NULL
  FROM steps s LEFT JOIN trajectories t ON t.id = s.trajectory_id WHERE s.started_at >= :since
  GROUP BY 1, 2, 3, 4, 5
"""
OUTCOMES = ("starting", "running", "ok", "failed", "timeout")
DIMENSIONS = ("agent", "model", "policy_version")


def _iso(moment: _dt.datetime) -> str:
    return moment.isoformat(timespec="milliseconds")


def live(conn, minutes: int = 30, now: _dt.datetime | None = None) -> dict:
    """Runs starting / running / ok / failed / timed out and steps and tokens per minute over the last ``minutes``,
    overall and per agent, model and policy version."""
    now = now or _dt.datetime.now(_dt.UTC)
    since = now - _dt.timedelta(minutes=minutes)
    params = {"since": _iso(since), "minute_ago": _iso(now - _dt.timedelta(minutes=1))}
    empty = lambda: {**dict.fromkeys(OUTCOMES, 0), "steps": 0, "tokens": 0, "steps_per_min": 0,
                     "tokens_per_min": 0}
    totals = empty()
    by = {d: defaultdict(empty) for d in DIMENSIONS}
    minute_keys = [_iso(since + _dt.timedelta(minutes=i))[:16] for i in range(minutes + 1)]
    series: dict = defaultdict(lambda: dict.fromkeys(minute_keys, 0))
    running = []
    for kind, agent, model, version, bucket, n, tokens, trajectory in conn.execute(LIVE, params):
        keys = {"agent": agent or "(none)", "model": model or "(none)", "policy_version": str(version or "(none)")}
        if kind == "running":
            running.append({"trajectory_id": trajectory, "agent": keys["agent"], "policy_version": version,
                            "started": bucket, "state": model})
            continue
        if kind == "runs":
            state = bucket if bucket in OUTCOMES else None
            for d in ("agent", "policy_version"):  # runs have no model of their own
                if state:
                    by[d][keys[d]][state] += n
            if state:
                totals[state] += n
            continue
        rows = [totals] + [by[d][keys[d]] for d in DIMENSIONS]
        for row in rows:
            row["steps"] += n
            row["tokens"] += tokens
            if kind == "last":
                row["steps_per_min"] += n
                row["tokens_per_min"] += tokens
        if bucket in minute_keys:
            series[keys["agent"]][bucket] += n
    return {"minutes": minutes, "since": params["since"], "now": _iso(now), "totals": totals,
            "by": {d: [{"key": k, **v} for k, v in sorted(rows.items())] for d, rows in by.items()},
            "series": {"minutes": [k[11:] for k in minute_keys],
                       "steps": {agent: list(counts.values()) for agent, counts in sorted(series.items())}},
            "running": running}


def _bucket_length(conn) -> tuple[int, str]:
    """Minutes for a short history, hours for days, days beyond (prefix lengths of an ISO time)."""
    first, last = conn.execute("SELECT min(started_at), max(started_at) FROM steps").fetchone()
    if not first:
        return 16, "minute"
    span = _dt.datetime.fromisoformat(last) - _dt.datetime.fromisoformat(first)
    if span < _dt.timedelta(hours=3):
        return 16, "minute"
    return (13, "hour") if span < _dt.timedelta(days=4) else (10, "day")


def charts(store: Store, *, trajectories: int = 300, groups: int = 12) -> dict:
    """Steps over time, reward per policy version and agent, turns and response tokens of recent
    trajectories, and the packed token ratio of recent groups."""
    conn = store.db.conn
    width, unit = _bucket_length(conn)
    steps = conn.execute(f"SELECT substr(started_at, 1, {width}), count(*) FROM steps GROUP BY 1").fetchall()
    rewards = conn.execute(
        "SELECT coalesce(policy_version, '(none)'), coalesce(json_extract(metadata, '$.agent'), '(none)'), "
        "avg(reward), count(reward) FROM trajectories WHERE reward IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
    recent = conn.execute(
        "SELECT t.id, coalesce(json_extract(t.metadata, '$.agent'), '(none)'), "
        "(SELECT count(*) FROM steps s WHERE s.trajectory_id = t.id), "
        "(SELECT coalesce(sum(output_tokens), 0) FROM steps s WHERE s.trajectory_id = t.id) "
        "FROM (SELECT * FROM trajectories ORDER BY created_at DESC LIMIT ?) t", [trajectories]).fetchall()
    group_ids = [g for (g,) in conn.execute(
        "SELECT group_id FROM (SELECT group_id, max(created_at) AS last FROM (SELECT group_id, created_at FROM "
        "trajectories WHERE group_id IS NOT NULL ORDER BY created_at DESC LIMIT 500) GROUP BY 1) "
        "ORDER BY last DESC LIMIT ?", [groups])]
    packed = []
    for group_id in group_ids:
        summary = group_summary(store, group_id)
        packed.append({"group_id": group_id, **summary})
    return {"steps": {"unit": unit, "labels": [b for b, _ in steps], "counts": [n for _, n in steps]},
            "reward": [{"policy_version": v, "agent": a, "mean": m, "n": n} for v, a, m, n in rewards],
            "trajectories": [{"id": i, "agent": a, "turns": turns, "response_tokens": tokens}
                             for i, a, turns, tokens in recent],
            "groups": packed}


# -- one group ---------------------------------------------------------------------------------
_GROUP_STEPS = f"""
SELECT s.id, s.trajectory_id, s.step_index, s.prompt_len, s.response_len, s.output_tokens, s.completion,
  ({curation.GATE_REASON}) AS gate
FROM steps s WHERE s.group_id = ? ORDER BY s.started_at, s.rowid
"""
_packed_cache: dict = {}
_cache_lock = threading.Lock()


def _signature(conn, group_id: str) -> tuple:
    """What a group's packing depends on: its steps and the reviews (the gate)."""
    return tuple(conn.execute("SELECT count(*), max(rowid), (SELECT max(id) FROM reviews) FROM steps "
                              "WHERE group_id = ?", [group_id]).fetchone())


def _pack(store: Store, group_id: str) -> dict:
    """Every step of the group with token ids packed into one trie, as the bridge's tree_batch packs
    them (prompt + response per step, loss on the response); the gated subset's ratio beside it."""
    from stepmill.trainer_bridge.prefix_tree import pack_tree

    steps = [dict(zip(("id", "trajectory_id", "step_index", "prompt_len", "response_len", "output_tokens",
                       "completion", "gate"), row)) for row in store.db.conn.execute(_GROUP_STEPS, [group_id])]
    with_ids = [s for s in steps if s["prompt_len"] is not None]
    sequences, masks = [], []
    for step in with_ids:
        prompt, response, _ = store.token_sequences(step["id"])
        sequences.append(np.concatenate([prompt, response]).astype(np.int64))
        masks.append(np.concatenate([np.zeros(len(prompt), bool), np.ones(len(response), bool)]))
    tree = pack_tree(sequences, masks) if sequences else None
    kept = [i for i, s in enumerate(with_ids) if s["gate"] is None]
    gated = pack_tree([sequences[i] for i in kept], [masks[i] for i in kept]) if kept else None
    return {"steps": steps, "with_ids": with_ids, "sequences": sequences, "tree": tree, "gated": gated}


def packed(store: Store, group_id: str) -> dict:
    key = _signature(store.db.conn, group_id)
    with _cache_lock:
        hit = _packed_cache.get(group_id)
        if hit and hit[0] == key:
            return hit[1]
    value = _pack(store, group_id)
    with _cache_lock:
        if len(_packed_cache) > 256:
            _packed_cache.clear()
        _packed_cache[group_id] = (key, value)
    return value


def group_summary(store: Store, group_id: str) -> dict:
    pack = packed(store, group_id)
    rewards = [r for (r,) in store.db.conn.execute("SELECT reward FROM trajectories WHERE group_id = ?", [group_id])]
    scored = [r for r in rewards if r is not None]

    def ratio(tree):
        return None if tree is None else round(tree.token_ratio, 4)

    return {"rollouts": len(rewards), "mean_reward": sum(scored) / len(scored) if scored else None,
            "spread": (max(scored) - min(scored)) if scored else None,
            "token_ratio": ratio(pack["tree"]), "gated_token_ratio": ratio(pack["gated"]),
            "packed_tokens": 0 if pack["tree"] is None else len(pack["tree"].input_ids),
            "original_tokens": 0 if pack["tree"] is None else int(pack["tree"].original_tokens)}


def segments(tree, owners: list[str], limit: int = 400) -> list[dict]:
    """The packed trie cut at its branch points: each segment a run of tokens with one child chain,
    its parent segment, its depth, and the sequences (by index) that hold it."""
    size = len(tree.input_ids)
    parent = tree.parent
    children = np.bincount(parent[parent >= 0], minlength=size)
    starts = np.flatnonzero((parent < 0) | (children[np.maximum(parent, 0)] != 1))
    seg_of = np.searchsorted(starts, np.arange(size), side="right") - 1
    holders: list[set] = [set() for _ in starts]
    ends: list[list] = [[] for _ in starts]
    for i in range(len(tree.seq_offsets) - 1):
        positions = tree.sequence(i)
        if not len(positions):
            continue
        for seg in np.unique(seg_of[positions]):
            holders[seg].add(i)
        ends[seg_of[positions[-1]]].append(i)
    out = []
    for j, start in enumerate(starts[:limit]):
        stop = starts[j + 1] if j + 1 < len(starts) else size
        out.append({"id": j, "parent": int(seg_of[parent[start]]) if parent[start] >= 0 else None,
                    "depth": int(tree.position_ids[start]), "length": int(stop - start),
                    "head": [int(t) for t in tree.input_ids[start:min(stop, start + 12)]],
                    "sequences": sorted(holders[j]), "rollouts": sorted({owners[i] for i in holders[j]}),
                    "ends": sorted(ends[j])})
    return out


def group(store: Store, group_id: str) -> dict:
    """The rollouts of a group side by side and the tree of their shared prefixes."""
    conn = store.db.conn
    rows = store.query("SELECT * FROM trajectories WHERE group_id = ? ORDER BY id", [group_id])
    if not rows:
        raise KeyError(group_id)
    pack = packed(store, group_id)
    scored = [r["reward"] for r in rows if r["reward"] is not None]
    mean = sum(scored) / len(scored) if scored else None
    by_trajectory: dict = defaultdict(list)
    for step in pack["steps"]:
        by_trajectory[step["trajectory_id"]].append(step)
    rollouts = []
    for row in rows:
        meta = loads(row["metadata"]) or {}
        steps = sorted(by_trajectory[row["id"]], key=lambda s: (s["step_index"] is None, s["step_index"]))
        last = loads(steps[-1]["completion"]) if steps and steps[-1]["completion"] else None
        rollouts.append({
            "trajectory_id": row["id"], "agent": meta.get("agent"), "status": row["status"],
            "outcome": meta.get("outcome"), "reward": row["reward"],
            "advantage": None if row["reward"] is None or mean is None else row["reward"] - mean,
            "steps": len(steps), "response_tokens": sum(s["output_tokens"] or 0 for s in steps),
            "kept_steps": sum(s["gate"] is None for s in steps), "review": curation.review_state(conn, "trajectory",
                                                                                                row["id"]),
            "last_completion": last, "policy_version": row["policy_version"]})
    tree = pack["tree"]
    owners = [s["trajectory_id"] for s in pack["with_ids"]]
    nodes = segments(tree, owners) if tree is not None else []
    steps = pack["with_ids"]
    for node in nodes:  # each segment links to the step whose tokens it starts in, per rollout through it
        node["steps"] = _steps_at(steps, node)
        node["ends"] = [{"trajectory_id": steps[i]["trajectory_id"], "step_id": steps[i]["id"],
                         "step_index": steps[i]["step_index"], "at": len(pack["sequences"][i])} for i in node["ends"]]
    return {"group_id": group_id, "rollouts": rollouts, "mean_reward": mean, "nodes": nodes,
            "summary": group_summary(store, group_id),
            "left_out": len(pack["steps"]) - len(pack["with_ids"])}


def _steps_at(steps: list[dict], node: dict) -> list[dict]:
    """Per rollout through the segment, its first step whose sequence reaches the segment's start."""
    depth, found = node["depth"], {}
    for i in node["sequences"]:
        step = steps[i]
        reach = (step["prompt_len"] or 0) + (step["response_len"] or 0)
        best = found.get(step["trajectory_id"])
        if reach > depth and (best is None or (step["step_index"] or 0) < (best["step_index"] or 0)):
            found[step["trajectory_id"]] = step
    return [{"trajectory_id": t, "step_id": s["id"], "step_index": s["step_index"],
             "part": "prompt" if depth < (s["prompt_len"] or 0) else "response"} for t, s in sorted(found.items())]
