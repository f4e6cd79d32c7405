"""The lifecycle in numbers: collected → tokenized → scored → reviewed → trainable → consumed.

Overall and per agent (the runner's name for it, with the HTTP user agents beside), model and
channel, and the gate's counts, for the UI's lifecycle page. One pass over the steps: every
breakdown is summed from the same grouped rows.
"""

from __future__ import annotations

from collections import defaultdict

from stepmill.store import curation

STAGES = ["collected", "tokenized", "rewarded", "reviewed", "trainable"]

# Over ``steps s LEFT JOIN trajectories t LEFT JOIN blobs h ON h.hash = s.headers_hash``.
USER_AGENT = "coalesce(json_extract(h.body, '$.\"user-agent\"'), '(none)')"
AGENT = "coalesce(json_extract(t.metadata, '$.agent'), '(none)')"  # the rollout runner's agent name
HEADERS_JOIN = "LEFT JOIN blobs h ON h.hash = s.headers_hash"

_PASS = f"""
SELECT {AGENT} AS agent, {USER_AGENT} AS user_agent, coalesce(s.model, '(none)') AS model,
  coalesce(s.channel, '(none)') AS channel, ({curation.GATE_REASON}) AS gate,
  count(*) AS collected,
  sum(s.token_provenance != 'none') AS tokenized,
  sum(s.reward IS NOT NULL OR t.reward IS NOT NULL) AS rewarded,
  sum(EXISTS (SELECT 1 FROM reviews r WHERE (r.target_kind = 'step' AND r.target_id = s.id)
             OR (r.target_kind = 'trajectory' AND r.target_id = s.trajectory_id))) AS reviewed
FROM steps s LEFT JOIN trajectories t ON t.id = s.trajectory_id {HEADERS_JOIN}
GROUP BY 1, 2, 3, 4, 5
"""
KEYS = ("overall", "agent", "model", "channel")


def _rows(conn, sql: str, params=()) -> list[dict]:
    cursor = conn.execute(sql, params)
    columns = [d[0] for d in cursor.description]
    return [dict(zip(columns, row)) for row in cursor]


def lifecycle(conn) -> dict:
    sums = {name: defaultdict(lambda: dict.fromkeys(STAGES, 0)) for name in KEYS}
    user_agents: dict[str, dict[str, int]] = defaultdict(dict)
    gate: dict = defaultdict(int)
    for row in _rows(conn, _PASS):
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
    out["trajectories"] = dict(zip(["total", "complete", "scored", "groups"], conn.execute(
        "SELECT count(*), sum(status = 'complete'), sum(EXISTS (SELECT 1 FROM rewards r WHERE r.target_kind = "
        "'trajectory' AND r.target_id = t.id AND r.value IS NOT NULL)), count(DISTINCT group_id) FROM trajectories t"
    ).fetchone()))
    out["by_provenance"] = dict(conn.execute("SELECT token_provenance, count(*) FROM steps GROUP BY 1").fetchall())
    by_consumer = _rows(conn, "SELECT consumer, count(*) AS groups, coalesce(sum(rows), 0) AS rows, max(acked_at) AS "
                              "last FROM consumption WHERE status = 'acked' GROUP BY consumer ORDER BY last DESC")
    out["consumed"] = {"groups": sum(r["groups"] for r in by_consumer), "rows": sum(r["rows"] for r in by_consumer),
                       "by_consumer": by_consumer,
                       "leased": conn.execute("SELECT count(*) FROM consumption WHERE status = 'leased'").fetchone()[0],
                       "stale": conn.execute("SELECT count(*) FROM consumption WHERE status = 'stale'").fetchone()[0]}
    return out
