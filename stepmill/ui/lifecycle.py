"""The lifecycle page's numbers: collected → tokenized → scored → reviewed → trainable → consumed.

Overall and per agent (the runner's name for it, with the HTTP user agents beside), model and
channel, and the gate's counts. One pass over the steps (``views.lifecycle_rows``): every
breakdown is summed here from the same grouped rows.
"""

from __future__ import annotations

from collections import defaultdict

from stepmill.store import Store, views

STAGES = ["collected", "tokenized", "rewarded", "reviewed", "trainable"]
KEYS = ("overall", "agent", "model", "channel")


def lifecycle(store: Store) -> dict:
    """The page's numbers from one file's ``Store``."""
    sums = {name: defaultdict(lambda: dict.fromkeys(STAGES, 0)) for name in KEYS}
    user_agents: dict[str, dict[str, int]] = defaultdict(dict)
    gate: dict = defaultdict(int)
    for row in views.lifecycle_rows(store):
        row["trainable"] = row["collected"] if row["gate"] is None else 0
        gate[row["gate"]] += row["collected"]
        ua = user_agents[row["agent"]]
        ua[row["user_agent"]] = ua.get(row["user_agent"], 0) + row["collected"]
        for name in KEYS:
            totals = sums[name]["all" if name == "overall" else row[name]]
            for stage in STAGES:
                totals[stage] += row[stage] or 0
    out: dict = {}
    for name in KEYS:
        rows = [{"key": key, **totals} for key, totals in sums[name].items()]
        out[name] = sorted(rows, key=lambda r: -r["collected"])[:50]
    for row in out["agent"]:  # the user agents stay visible beside the runner's name
        row["user_agent"] = ", ".join(sorted(user_agents[row["key"]], key=lambda u: -user_agents[row["key"]][u])[:3])
    kept = gate.pop(None, 0)
    out["gate"] = {"kept": kept, "removed": sum(gate.values()), "removed_by_reason": dict(gate)}
    out["trajectories"] = views.trajectory_counts(store)
    out["by_provenance"] = views.steps_by_provenance(store)
    by_consumer = views.consumption_by_consumer(store)
    out["consumed"] = {"groups": sum(r["groups"] for r in by_consumer), "rows": sum(r["rows"] for r in by_consumer),
                       "by_consumer": by_consumer,
                       "leased": views.consumption_count(store, "leased"),
                       "stale": views.consumption_count(store, "stale")}
    return out
