"""The lifecycle in numbers: collected → tokenized → scored → reviewed → trainable → consumed.

Overall and per agent (its user-agent), model and channel, for the UI's lifecycle page.
"""

from __future__ import annotations

from . import curation

STAGES = ["collected", "tokenized", "rewarded", "reviewed", "trainable"]

_PER_STEP = f"""
SELECT {{key}} AS key,
  count(*) AS collected,
  sum(s.token_provenance != 'none') AS tokenized,
  sum(s.reward IS NOT NULL OR t.reward IS NOT NULL) AS rewarded,
  sum(EXISTS (SELECT 1 FROM reviews r WHERE (r.target_kind = 'step' AND r.target_id = s.id)
             OR (r.target_kind = 'trajectory' AND r.target_id = s.trajectory_id))) AS reviewed,
  sum(({curation.GATE_REASON}) IS NULL) AS trainable
FROM steps s LEFT JOIN trajectories t ON t.id = s.trajectory_id
LEFT JOIN blobs h ON h.hash = s.headers_hash
GROUP BY 1 ORDER BY collected DESC LIMIT 50
"""
KEYS = {
    "overall": "'all'",
    "agent": "coalesce(json_extract(h.body, '$.\"user-agent\"'), '(none)')",
    "model": "coalesce(s.model, '(none)')",
    "channel": "s.channel",
}


def lifecycle(conn) -> dict:
    out = {}
    for name, key in KEYS.items():
        cursor = conn.execute(_PER_STEP.format(key=key))
        columns = [d[0] for d in cursor.description]
        out[name] = [dict(zip(columns, row)) for row in cursor]
    out["trajectories"] = dict(zip(["total", "complete", "scored", "groups"], conn.execute(
        "SELECT count(*), sum(status = 'complete'), sum(EXISTS (SELECT 1 FROM rewards r WHERE r.target_kind = "
        "'trajectory' AND r.target_id = t.id AND r.value IS NOT NULL)), count(DISTINCT group_id) FROM trajectories t"
    ).fetchone()))
    out["by_provenance"] = dict(conn.execute("SELECT token_provenance, count(*) FROM steps GROUP BY 1").fetchall())
    cursor = conn.execute("SELECT consumer, count(*) AS groups, coalesce(sum(rows), 0) AS rows, max(acked_at) AS last "
                          "FROM consumption WHERE status = 'acked' GROUP BY consumer ORDER BY last DESC")
    columns = [d[0] for d in cursor.description]
    by_consumer = [dict(zip(columns, row)) for row in cursor]
    out["consumed"] = {"groups": sum(r["groups"] for r in by_consumer), "rows": sum(r["rows"] for r in by_consumer),
                       "by_consumer": by_consumer,
                       "leased": conn.execute("SELECT count(*) FROM consumption WHERE status = 'leased'").fetchone()[0],
                       "stale": conn.execute("SELECT count(*) FROM consumption WHERE status = 'stale'").fetchone()[0]}
    return out
