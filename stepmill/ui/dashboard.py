"""What the dashboard pages show: live runs (the live page), charts (the lifecycle page), and one
group's rollouts with their prefix tree (the group page).

``live`` shapes one indexed query over a recent window (``views.LIVE``), so a refresh costs the
same whatever the file's size. ``group`` packs a group's steps with the bridge's own ``pack_tree``
and cuts the packed trie into the segments the page draws.
"""

from __future__ import annotations

import datetime as _dt
import threading
from collections import defaultdict

import numpy as np

from stepmill.errors import NotFound
from stepmill.store import Store, views
from stepmill.store.encoding import loads
from stepmill.store.ids import iso

OUTCOMES = ("starting", "running", "ok", "failed", "timeout")
DIMENSIONS = ("agent", "model", "policy_version")


def live(store: Store, minutes: int = 30, now: _dt.datetime | None = None) -> dict:
    """Runs starting / running / ok / failed / timed out and steps and tokens per minute over the last ``minutes``,
    overall and per agent, model and policy version."""
    now = now or _dt.datetime.now(_dt.UTC)
    since = now - _dt.timedelta(minutes=minutes)
    since_iso = iso(since)
    empty = lambda: {**dict.fromkeys(OUTCOMES, 0), "steps": 0, "tokens": 0, "steps_per_min": 0,
                     "tokens_per_min": 0}
    totals = empty()
    by = {d: defaultdict(empty) for d in DIMENSIONS}
    minute_keys = [iso(since + _dt.timedelta(minutes=i))[:16] for i in range(minutes + 1)]
    series: dict = defaultdict(lambda: dict.fromkeys(minute_keys, 0))
    running = []
    rows = views.live_rows(store, since_iso, iso(now - _dt.timedelta(minutes=1)))
    for kind, agent, model, version, bucket, n, tokens, trajectory in rows:
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
    return {"minutes": minutes, "since": since_iso, "now": iso(now), "totals": totals,
            "by": {d: [{"key": k, **v} for k, v in sorted(rows.items())] for d, rows in by.items()},
            "series": {"minutes": [k[11:] for k in minute_keys],
                       "steps": {agent: list(counts.values()) for agent, counts in sorted(series.items())}},
            "running": running}


def _bucket_length(store: Store) -> tuple[int, str]:
    """Minutes for a short history, hours for days, days beyond (prefix lengths of an ISO time)."""
    first, last = views.step_time_span(store)
    if not first:
        return 16, "minute"
    span = _dt.datetime.fromisoformat(last) - _dt.datetime.fromisoformat(first)
    if span < _dt.timedelta(hours=3):
        return 16, "minute"
    return (13, "hour") if span < _dt.timedelta(days=4) else (10, "day")


def charts(store: Store, *, trajectories: int = 300, groups: int = 12) -> dict:
    """Steps over time, reward per policy version and agent, turns and response tokens of recent
    trajectories, and the packed token ratio of recent groups."""
    width, unit = _bucket_length(store)
    steps = views.steps_per_bucket(store, width)
    rewards = views.reward_by_version_and_agent(store)
    recent = views.recent_trajectory_sizes(store, trajectories)
    group_ids = views.recent_group_ids(store, groups)
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
_packed_cache: dict = {}
_cache_lock = threading.Lock()


def _pack(store: Store, group_id: str) -> dict:
    """Every step of the group with token ids packed into one trie, as the bridge's tree_batch packs
    them (prompt + response per step, loss on the response); the gated subset's ratio beside it."""
    from stepmill.trainer_bridge.prefix_tree import pack_tree

    steps = views.group_steps(store, group_id)
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
    key = views.group_signature(store, group_id)  # what the packing depends on: steps and reviews
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
    rewards = views.group_rewards(store, group_id)
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
    rows = views.group_trajectories(store, group_id)
    if not rows:
        raise NotFound(f"group {group_id!r}")
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
            "kept_steps": sum(s["gate"] is None for s in steps),
            "review": views.review_state(store, "trajectory", row["id"]),
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
