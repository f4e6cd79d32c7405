"""The queries behind the UI's pages (lifecycle, live dashboard, charts, groups, step views), and the
stored queries Datasette lists beside its tables.

Each function takes the page's ``Store`` and returns plain rows: tuples, dicts or numbers. Shaping
the rows into pages and charts is the UI's job.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any, Iterator

from stepmill.store import curation

if TYPE_CHECKING:
    from stepmill.store.db import Store


def _connection(store: Store) -> sqlite3.Connection:
    return store.db.conn


def _dicts(conn: sqlite3.Connection, sql: str, params: Any = ()) -> list[dict]:
    cursor = conn.execute(sql, params)
    columns = [d[0] for d in cursor.description]
    return [dict(zip(columns, row)) for row in cursor]


# -- who made a step: the user-agent grouping the lifecycle page and the by_agent query share ------
# Over ``steps s LEFT JOIN trajectories t LEFT JOIN blobs h ON h.hash = s.headers_hash``.
USER_AGENT = "coalesce(json_extract(h.body, '$.\"user-agent\"'), '(none)')"
AGENT = "coalesce(json_extract(t.metadata, '$.agent'), '(none)')"  # the rollout runner's agent name
HEADERS_JOIN = "LEFT JOIN blobs h ON h.hash = s.headers_hash"


# -- lifecycle ------------------------------------------------------------------------------------
# One pass over the steps: every breakdown the page shows is summed from these grouped rows.
LIFECYCLE_PASS = f"""
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


def lifecycle_rows(store: Store) -> list[dict]:
    """Step counts per stage, grouped by agent, user agent, model, channel and the gate's reason."""
    return _dicts(_connection(store), LIFECYCLE_PASS)


def trajectory_counts(store: Store) -> dict:
    """Trajectories: total, complete, scored (a trajectory reward recorded) and distinct groups."""
    row = _connection(store).execute(
        "SELECT count(*), sum(status = 'complete'), sum(EXISTS (SELECT 1 FROM rewards r WHERE r.target_kind = "
        "'trajectory' AND r.target_id = t.id AND r.value IS NOT NULL)), count(DISTINCT group_id) FROM trajectories t"
    ).fetchone()
    return dict(zip(["total", "complete", "scored", "groups"], row))


def holds(store: Store, kind: str, item_id: str) -> bool:
    """Whether the file holds the step, trajectory or group (a page of several files finds its file so)."""
    sql = {"steps": "SELECT 1 FROM steps WHERE id = ?", "trajectories": "SELECT 1 FROM trajectories WHERE id = ?",
           "groups": "SELECT 1 FROM trajectories WHERE group_id = ? LIMIT 1"}[kind]
    return _connection(store).execute(sql, [item_id]).fetchone() is not None


# -- a node of the fleet: what its file says of the runs a runner registered on it -----------------------
# One row per registered run (its latest registration), with its group's size on this node: the runner
# registers every run of a rollout before any starts, so once one is complete the count is whole.
def steps_by_provenance(store: Store) -> dict:
    return dict(_connection(store).execute("SELECT token_provenance, count(*) FROM steps GROUP BY 1").fetchall())


def consumption_by_consumer(store: Store) -> list[dict]:
    """Acknowledged groups and rows per consumer, the most recent first."""
    return _dicts(_connection(store), "SELECT consumer, count(*) AS groups, coalesce(sum(rows), 0) AS rows, "
                                       "max(acked_at) AS last FROM consumption WHERE status = 'acked' "
                                       "GROUP BY consumer ORDER BY last DESC")


def consumption_count(store: Store, status: str) -> int:
    """How many groups are in one consumption state (leased, stale, acked)."""
    return _connection(store).execute("SELECT count(*) FROM consumption WHERE status = ?", [status]).fetchone()[0]


# -- the live page ----------------------------------------------------------------------------------
# An open run is starting until its first step is recorded (it may wait for a slot), then running.
_OPEN_STATE = ("CASE WHEN json_extract(r.metadata, '$.outcome') IS NOT NULL THEN 'finishing' WHEN EXISTS "
               "(SELECT 1 FROM steps s WHERE s.trajectory_id = r.id) THEN 'running' ELSE 'starting' END")
_RUN_STATE = (f"CASE WHEN r.status = 'open' THEN {_OPEN_STATE} "
              "ELSE coalesce(json_extract(r.metadata, '$.outcome'), 'complete') END")
# Rows: kind, agent, model, policy_version, bucket, n, tokens, trajectory. ``recent``: runs registered or
# finished in the window (a rerun registers again, so it counts as running from its new start).
# Every part is read through an index (run_credentials.created_at, trajectories.completed_at,
# steps.started_at), so a refresh costs the same whatever the file's size.
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


def live_rows(store: Store, since: str, minute_ago: str) -> list[tuple]:
    """The live window's rows (see ``LIVE``): runs by state, the open runs, steps and tokens per minute."""
    return _connection(store).execute(LIVE, {"since": since, "minute_ago": minute_ago}).fetchall()


# -- the lifecycle page's charts ----------------------------------------------------------------------
def step_time_span(store: Store) -> tuple[str | None, str | None]:
    """The first and the last step's start time."""
    return tuple(_connection(store).execute("SELECT min(started_at), max(started_at) FROM steps").fetchone())


def steps_per_bucket(store: Store, width: int) -> list[tuple[str, int]]:
    """Steps per time bucket, a bucket being the first ``width`` characters of the ISO start time."""
    return _connection(store).execute(
        f"SELECT substr(started_at, 1, {int(width)}), count(*) FROM steps GROUP BY 1").fetchall()


def reward_by_version_and_agent(store: Store) -> list[tuple]:
    """(policy version, agent, mean trajectory reward, rewarded trajectories)."""
    return _connection(store).execute(
        "SELECT coalesce(policy_version, '(none)'), coalesce(json_extract(metadata, '$.agent'), '(none)'), "
        "avg(reward), count(reward) FROM trajectories WHERE reward IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2").fetchall()


def recent_trajectory_sizes(store: Store, limit: int) -> list[tuple]:
    """(trajectory id, agent, turns, response tokens) of the ``limit`` newest trajectories."""
    return _connection(store).execute(
        "SELECT t.id, coalesce(json_extract(t.metadata, '$.agent'), '(none)'), "
        "(SELECT count(*) FROM steps s WHERE s.trajectory_id = t.id), "
        "(SELECT coalesce(sum(output_tokens), 0) FROM steps s WHERE s.trajectory_id = t.id) "
        "FROM (SELECT * FROM trajectories ORDER BY created_at DESC LIMIT ?) t", [limit]).fetchall()


def recent_group_ids(store: Store, limit: int) -> list[str]:
    """The ``limit`` groups with the newest trajectories (looked for among the latest 500)."""
    return [g for (g,) in _connection(store).execute(
        "SELECT group_id FROM (SELECT group_id, max(created_at) AS last FROM (SELECT group_id, created_at FROM "
        "trajectories WHERE group_id IS NOT NULL ORDER BY created_at DESC LIMIT 500) GROUP BY 1) "
        "ORDER BY last DESC LIMIT ?", [limit])]


# -- one group ------------------------------------------------------------------------------------
GROUP_STEPS = f"""
SELECT s.id, s.trajectory_id, s.step_index, s.prompt_len, s.response_len, s.output_tokens, s.completion,
  ({curation.GATE_REASON}) AS gate
FROM steps s WHERE s.group_id = ? ORDER BY s.started_at, s.rowid
"""


def group_steps(store: Store, group_id: str) -> list[dict]:
    """The group's steps in the order they started, with the gate's reason (None: kept)."""
    return _dicts(_connection(store), GROUP_STEPS, [group_id])


def group_signature(store: Store, group_id: str) -> tuple:
    """What a group's packing depends on: its steps and the reviews (the gate)."""
    return tuple(_connection(store).execute("SELECT count(*), max(rowid), (SELECT max(id) FROM reviews) FROM steps "
                                             "WHERE group_id = ?", [group_id]).fetchone())


def group_rewards(store: Store, group_id: str) -> list[float | None]:
    """Each of the group's trajectories' reward (None: not scored)."""
    return [r for (r,) in _connection(store).execute("SELECT reward FROM trajectories WHERE group_id = ?",
                                                      [group_id])]


def group_trajectories(store: Store, group_id: str) -> list[dict]:
    """The group's trajectory rows, by id (metadata as stored, JSON text)."""
    return _dicts(_connection(store), "SELECT * FROM trajectories WHERE group_id = ? ORDER BY id", [group_id])


def review_state(store: Store, kind: str, target_id: str) -> dict:
    """A step's or trajectory's current label, trainable flag, tags and notes."""
    return curation.review_state(_connection(store), kind, target_id)


# -- step and trajectory pages --------------------------------------------------------------------
def messages_base_len(store: Store, step_id: str) -> int | None:
    """How many of the step's messages its parent's conversation already holds."""
    row = _connection(store).execute("SELECT messages_base_len FROM steps WHERE id = ?", [step_id]).fetchone()
    return row[0] if row else None


def messages_base_lens(store: Store, trajectory_id: str) -> dict[str, int]:
    """``messages_base_len`` of every step of a trajectory, by step id (0 when unknown)."""
    return {step_id: shared or 0 for step_id, shared in _connection(store).execute(
        "SELECT id, messages_base_len FROM steps WHERE trajectory_id = ?", [trajectory_id])}


def trajectory_steps(store: Store, trajectory_id: str) -> Iterator[dict]:
    """A trajectory's steps as exported records, without token ids."""
    return store.iter_steps(trajectory_id=trajectory_id, with_tokens=False)


# -- Datasette's stored queries (listed on the database page) -----------------------------------------
STORED_QUERIES: dict[str, dict] = {
    "recent_steps": {
        "title": "Recent steps",
        "sql": "select id, trajectory_id, step_index, api, model, status, finish_reason, "
               "input_tokens, output_tokens, ttft_ms, started_at from steps "
               "order by started_at desc limit 100",
    },
    "search": {
        "title": "Search conversations and completions",
        "description": 'Full-text (SQLite FTS5), e.g. "rm -rf" with the quotes',
        "sql": "select s.id, s.trajectory_id, s.step_index, s.model, s.status, "
               "snippet(steps_fts, -1, '[', ']', '…', 12) as match from steps_fts "
               "join steps s on s.rowid = steps_fts.rowid where steps_fts match :q "
               "order by rank limit 200",
    },
    "unreviewed": {
        "title": "Unreviewed trajectories",
        "sql": "select t.id, t.group_id, t.status, t.reward, t.created_at from trajectories t "
               "where not exists (select 1 from reviews r where r.target_kind = 'trajectory' and "
               "r.target_id = t.id) and not exists (select 1 from reviews r join steps s on "
               "r.target_kind = 'step' and r.target_id = s.id where s.trajectory_id = t.id) "
               "order by t.created_at desc limit 500",
    },
    "failed": {"title": "Failed and incomplete steps",
               "sql": "select id, trajectory_id, status, error, model, started_at from steps "
                      "where status != 'ok' order by started_at desc limit 500"},
    "truncated": {"title": "Truncated completions",
                  "sql": "select id, trajectory_id, model, finish_reason, output_tokens from "
                         "step_quality q join steps s using (id) where q.truncated order by "
                         "q.started_at desc limit 500"},
    "drifted": {"title": "Token drift (a child that does not continue its parent's ids)",
                "sql": "select id, trajectory_id, divergence_pos, divergence_reason, token_provenance "
                       "from steps where consistency = 'divergent' order by started_at desc limit 500"},
    "reward_missing": {"title": "Completed trajectories without a reward",
                       "sql": "select id, group_id, completed_at from trajectories where status = "
                              "'complete' and reward is null order by completed_at desc limit 500"},
    "stale": {"title": "Steps from older policy versions",
              "sql": "select id, trajectory_id, staleness from step_quality where staleness > 0 "
                     "order by staleness desc limit 500"},
    "by_agent": {"title": "Steps by agent (the runner's name; user agent beside)",
                 "sql": f"select {AGENT} as agent, {USER_AGENT} as user_agent, count(*) as steps, "
                        "sum(s.status != 'ok') as failed, sum(s.token_provenance = 'exact') as "
                        "exact_ids from steps s left join trajectories t on t.id = s.trajectory_id "
                        f"{HEADERS_JOIN} group by 1, 2 order by steps desc"},
    "trajectory_summary": {
        "title": "Trajectories with step counts",
        "sql": "select t.id, t.group_id, t.status, t.reward, count(s.id) as steps, "
               "sum(s.status != 'ok') as failed_steps, min(s.started_at) as first_step "
               "from trajectories t left join steps s on s.trajectory_id = t.id "
               "group by t.id order by first_step desc",
    },
}
