"""Ordered schema migrations. Append new ones; never edit one that has shipped."""

from __future__ import annotations

import datetime as _dt
from typing import Callable

from stepmill.store.sqlite_library import sqlite_utils


def _m001_capture(db: sqlite_utils.Database) -> None:
    db["blobs"].create({"hash": str, "body": str}, pk="hash")
    db["state"].create({"key": str, "value": str}, pk="key")
    db["trajectories"].create(
        {
            "id": str,
            "group_id": str,
            "channel": str,
            "source": str,  # explicit | session | chain | conversation | api
            "status": str,  # open | complete
            "reward": float,
            "metadata": str,
            "policy_version": str,
            "created_at": str,
            "completed_at": str,
        },
        pk="id",
        defaults={"channel": "train", "status": "open"},
    )
    db["steps"].create(
        {
            "id": str,
            "trajectory_id": str,
            "group_id": str,
            "parent_step_id": str,
            "step_index": int,
            "api": str,
            "transport": str,
            "host": str,
            "path": str,
            "model": str,
            "response_id": str,
            "request_hash": str,
            "message_count": int,
            "messages_base_len": int,
            "messages_suffix": str,
            "wire_base_len": int,
            "wire_suffix": bytes,  # zlib-compressed JSON: the wire form is archival, rarely read
            "completion": str,
            "wire_completion": bytes,  # zlib-compressed JSON
            "finish_reason": str,
            "usage": str,
            "input_tokens": int,
            "output_tokens": int,
            "cache_read_tokens": int,
            "cache_write_tokens": int,
            "status": str,
            "error": str,
            "http_status": int,
            "ttft_ms": float,
            "duration_ms": float,
            "started_at": str,
            "channel": str,
            "policy_version": str,
            "reward": float,
            "headers_hash": str,  # identifying request headers, in blobs (agents repeat them every call)
            "link_key": str,
            "continuation_key": str,
            "metadata": str,
            "raw_request": bytes,
            "raw_response": bytes,
        },
        pk="id",
        foreign_keys=[
            ("trajectory_id", "trajectories", "id"),
            ("parent_step_id", "steps", "id"),
            ("request_hash", "blobs", "hash"),
            ("headers_hash", "blobs", "hash"),
        ],
        defaults={"channel": "train", "status": "ok"},
    )
    db["steps"].create_index(["trajectory_id", "step_index"])
    db["steps"].create_index(["continuation_key"])
    db["steps"].create_index(["response_id"])
    db["steps"].create_index(["started_at"])
    db["trajectories"].create_index(["group_id"])


def _m002_tokens(db: sqlite_utils.Database) -> None:
    steps = db["steps"]
    # Prompt ids are stored as a delta against the parent's prompt+response ids (int32 little endian),
    # response ids and logprobs whole (int32 / float32).
    for name, typ in [
        ("token_provenance", str),  # none | exact | rendered | spliced
        ("prompt_len", int),
        ("prompt_base_len", int),
        ("prompt_suffix", bytes),
        ("response_len", int),
        ("response_ids", bytes),
        ("logprobs", bytes),
        ("spliced_len", int),  # leading prompt tokens taken from the parent's exact ids
        ("tokenizer", str),
        ("fidelity", str),  # ok | divergent (rendering could not reproduce itself)
        ("fidelity_detail", str),
        ("consistency", str),  # consistent | divergent | root (parent→child token prefix check)
        ("divergence_pos", int),
        ("divergence_reason", str),
    ]:
        steps.add_column(name, typ)
    db.execute("UPDATE steps SET token_provenance = 'none' WHERE token_provenance IS NULL")


def _m003_linking(db: sqlite_utils.Database) -> None:
    steps = db["steps"]
    for name, typ in [
        ("loose_key", str),  # continuation key with system messages left out (volatile system prompts)
        ("system_hash", str),  # the system prompt exactly as sent, hashed
        ("system_changed", int),  # 1 when it differs from the parent's
        ("client_conn", str),  # the agent's connection, to keep concurrent rollouts apart
    ]:
        steps.add_column(name, typ)
    steps.create_index(["parent_step_id"])
    steps.create_index(["continuation_key", "trajectory_id"])
    steps.create_index(["loose_key", "trajectory_id"])


def _m004_curation(db: sqlite_utils.Database) -> None:
    # Append-only: a target's history stays; its current reward and review state are derived.
    db["rewards"].create({
        "id": int, "target_kind": str, "target_id": str,  # step | trajectory
        "value": float, "source": str,  # rule | model | human | env | api
        "name": str, "note": str, "details": str, "idempotency_key": str, "created_at": str,
    }, pk="id")
    db["rewards"].create_index(["target_kind", "target_id"])
    db["rewards"].create_index(["idempotency_key"], unique=True)
    db["reviews"].create({
        "id": int, "target_kind": str, "target_id": str, "reviewer": str,
        "action": str,  # label (good | bad | needs-fix) | trainable (true | false) | tag | note
        "value": str, "created_at": str,
    }, pk="id")
    db["reviews"].create_index(["target_kind", "target_id"])
    # Rewards recorded before this migration (control API columns) become rows of their history.
    db.execute("INSERT INTO rewards (target_kind, target_id, value, source, name, created_at)"
               " SELECT 'step', id, reward, 'api', 'control API', started_at FROM steps WHERE reward IS NOT NULL")
    db.execute("INSERT INTO rewards (target_kind, target_id, value, source, name, created_at)"
               " SELECT 'trajectory', id, reward, 'api', 'control API', coalesce(completed_at, created_at)"
               " FROM trajectories WHERE reward IS NOT NULL")


STEP_QUALITY = """
CREATE VIEW step_quality AS
SELECT s.id, s.trajectory_id, s.group_id, s.model, s.api, s.channel,
  s.finish_reason IN ('length', 'max_tokens', 'max_output_tokens') AS truncated,
  s.status AS status,
  (s.completion IS NULL OR (json_extract(s.completion, '$.content') IN ('', NULL)
     AND json_array_length(coalesce(json_extract(s.completion, '$.tool_calls'), '[]')) = 0)) AS empty_completion,
  s.token_provenance,
  coalesce(s.consistency, 'unknown') AS consistency,
  s.system_changed,
  (s.continuation_key IS NOT NULL AND EXISTS (SELECT 1 FROM steps d WHERE d.continuation_key = s.continuation_key
     AND d.id != s.id)) AS duplicate,
  (s.reward IS NOT NULL OR t.reward IS NOT NULL) AS reward_present,
  CASE WHEN s.policy_version IS NULL OR (SELECT value FROM state WHERE key = 'policy_version') IS NULL THEN NULL
       WHEN s.policy_version = (SELECT value FROM state WHERE key = 'policy_version') THEN 0
       WHEN CAST(s.policy_version AS INTEGER) || '' = s.policy_version
            AND CAST((SELECT value FROM state WHERE key = 'policy_version') AS INTEGER) || ''
                = (SELECT value FROM state WHERE key = 'policy_version')
         THEN CAST((SELECT value FROM state WHERE key = 'policy_version') AS INTEGER) - CAST(s.policy_version AS INTEGER)
       ELSE 1 END AS staleness,
  t.status = 'complete' AS trajectory_complete,
  s.started_at
FROM steps s LEFT JOIN trajectories t ON t.id = s.trajectory_id
"""

TRAJECTORY_QUALITY = """
CREATE VIEW trajectory_quality AS
SELECT t.id, t.group_id, t.channel, t.status, t.reward, count(q.id) AS steps,
  sum(q.status != 'ok') AS failed_steps, sum(q.truncated) AS truncated_steps,
  sum(q.empty_completion) AS empty_steps, sum(q.consistency = 'divergent') AS divergent_steps,
  sum(q.duplicate) AS duplicate_steps, sum(q.token_provenance = 'exact') AS exact_id_steps,
  max(q.staleness) AS max_staleness,
  (SELECT value FROM reviews r WHERE r.target_kind = 'trajectory' AND r.target_id = t.id AND r.action = 'label'
   ORDER BY r.id DESC LIMIT 1) AS label,
  t.created_at
FROM trajectories t LEFT JOIN step_quality q ON q.trajectory_id = t.id
GROUP BY t.id
"""


def _m005_quality_and_search(db: sqlite_utils.Database) -> None:
    # Quality signals are views: always current (a later reward, review or policy version counts at once).
    db.execute(STEP_QUALITY)
    db.execute(TRAJECTORY_QUALITY)
    # Full-text search over conversations and completions (their JSON text), kept current by triggers.
    db["steps"].enable_fts(["messages_suffix", "completion"], create_triggers=True, tokenize="unicode61")
    # Named reviewers sign in to the UI with a token; only its hash is kept.
    db["reviewers"].create({"name": str, "token_hash": str, "created_at": str}, pk="name")


def _m006_consumption(db: sqlite_utils.Database) -> None:
    # Each group is handed out once: leased to a consumer, then acknowledged (or leased again when
    # the lease runs out because the consumer died).
    db["consumption"].create({
        "group_id": str, "channel": str, "consumer": str, "claimed_at": str, "lease_until": float,
        "acked_at": str, "rows": int, "status": str,  # leased | acked | stale
    }, pk="group_id")
    db["consumption"].create_index(["status"])


def _m007_runs(db: sqlite_utils.Database) -> None:
    # Runs the rollout runner registered: only the hash of each run's secret is kept; a rerun
    # registers again (a new row, a new secret), so the newest row of a trajectory is the one in force.
    db["run_credentials"].create({"trajectory_id": str, "group_id": str, "channel": str, "secret_hash": str,
                                  "created_at": str})
    db["run_credentials"].create_index(["trajectory_id"])
    # A task's fields for scoring only (answers, tests): read by reward functions, served by no
    # surface an agent reaches (not in trajectories.metadata; the UI serves signed-in reviewers only).
    db["scoring_fields"].create({"trajectory_id": str, "fields": str}, pk="trajectory_id")


def _m008_dashboard(db: sqlite_utils.Database) -> None:
    # The live page reads only a recent window (runs registered or finished, steps started, all by
    # index); the group page and the bridge's tree read one group's steps.
    db["run_credentials"].create_index(["created_at"])
    db["trajectories"].create_index(["completed_at"])
    db["trajectories"].create_index(["created_at"])
    db["steps"].create_index(["group_id"])


def _m009_policy_history(db: sqlite_utils.Database) -> None:
    # Every policy version set, with when (epoch seconds): the writers of several proxy processes stamp
    # each call with the version in effect when it started, read here, not a value one process cached.
    db["policy_versions"].create({"set_at": float, "version": str})
    db["policy_versions"].create_index(["set_at"])
    current = db.conn.execute("SELECT value FROM state WHERE key = 'policy_version'").fetchone()
    if current is not None:  # set before this history was kept: in effect since always
        db.conn.execute("INSERT INTO policy_versions (set_at, version) VALUES (0, ?)", [current[0]])


def _m010_training(db: sqlite_utils.Database) -> None:
    # What `stepmill train` measured per policy version, for a run and its paired control.
    db["train_metrics"].create({"run": str, "version": int, "name": str, "value": float, "recorded_at": str},
                               pk=("run", "version", "name"))


def _m011_revocations(db: sqlite_utils.Database) -> None:
    # A run's secret dies with the run: a revocation is a newer row of the trajectory without a secret
    # (every reader of registrations takes the newest row of a trajectory as the one in force).
    db["run_credentials"].add_column("revoked_at", str)


def _m012_consumption_sessions(db: sqlite_utils.Database) -> None:
    # A trainer claims several groups for one optimizer step: the consumer instance (its session)
    # holding each, so it is never handed one it holds and a restart under the same name takes them
    # up; and how far behind the policy each group was when claimed (NULL: versions not integers).
    consumption = db["consumption"]
    for name, typ in [("holder", str), ("staleness", int), ("policy_version", str), ("oldest_version", str)]:
        consumption.add_column(name, typ)
    consumption.create_index(["consumer", "status"])


def _m013_doors(db: sqlite_utils.Database) -> None:
    # A sandboxed run's door, and the hosts (JSON list) it may reach through the proxy. The door column
    # held a loopback address when it was made; it holds the hash of the run's door key now (store/runs.py).
    db["run_credentials"].add_column("door", str)
    db["run_credentials"].add_column("hosts", str)


# What a call served through an engine's chat completions said of itself before engine_api (its note), and the
# protocol the agent spoke: those steps were stored with api openai.chat.
TRANSLATED_NOTES = {
    "anthropic.messages": "an Anthropic Messages call, served through the engine's chat completions for exact "
                          "token ids; the agent got the answer as Messages",
    "gemini.generate": "a Gemini generateContent call, served through the engine's chat completions for exact "
                       "token ids; the agent got the answer as Gemini's",
}


def _m014_engine_api(db: sqlite_utils.Database) -> None:
    # A step's api is the protocol the agent spoke; engine_api, the protocol of the exchange kept (path, params, raw
    # bodies) when the proxy served the call through another (an engine's chat completions), else NULL.
    db["steps"].add_column("engine_api", str)
    for api, note in TRANSLATED_NOTES.items():
        db.execute("UPDATE steps SET api = ?, engine_api = 'openai.chat' WHERE api = 'openai.chat'"
                   " AND metadata IS NOT NULL AND json_valid(metadata)"
                   " AND EXISTS (SELECT 1 FROM json_each(metadata, '$.notes') WHERE value = ?)", [api, note])


def _m015_lean_indexes(db: sqlite_utils.Database) -> None:
    # Every index is a page more in each commit of a captured call: steps(continuation_key) alone is the
    # prefix of steps(continuation_key, trajectory_id), which answers each of its lookups.
    db.execute("DROP INDEX IF EXISTS idx_steps_continuation_key")


SEARCH_MARK = "search_indexed"  # the state key: every steps rowid up to it is in steps_fts
SEARCH_MARK_SQL = f"coalesce((SELECT CAST(value AS INTEGER) FROM state WHERE key = '{SEARCH_MARK}'), 0)"


def _m016_search_later(db: sqlite_utils.Database) -> None:
    # Steps are put in the full-text index after their commit, in batches (store/search.py): the
    # insert trigger goes. Rows already indexed (at or under the mark) are kept current on a delete
    # and on an edit of the indexed columns only (a reward or a token column is no edit of the text).
    for trigger in ("steps_ai", "steps_ad", "steps_au"):
        db.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    db.execute(f"""CREATE TRIGGER steps_ad AFTER DELETE ON steps BEGIN
        INSERT INTO steps_fts (steps_fts, rowid, messages_suffix, completion)
          SELECT 'delete', old.rowid, old.messages_suffix, old.completion WHERE old.rowid <= {SEARCH_MARK_SQL};
        UPDATE state SET value = CAST(coalesce((SELECT max(rowid) FROM steps), 0) AS TEXT)
          WHERE key = '{SEARCH_MARK}' AND CAST(value AS INTEGER) > coalesce((SELECT max(rowid) FROM steps), 0);
    END""")  # the mark comes down with the newest rows deleted: the rowids they had are given again
    db.execute(f"""CREATE TRIGGER steps_au AFTER UPDATE OF messages_suffix, completion ON steps
      WHEN old.rowid <= {SEARCH_MARK_SQL} BEGIN
        INSERT INTO steps_fts (steps_fts, rowid, messages_suffix, completion)
          VALUES ('delete', old.rowid, old.messages_suffix, old.completion);
        INSERT INTO steps_fts (rowid, messages_suffix, completion) VALUES (new.rowid, new.messages_suffix, new.completion);
    END""")
    db.execute("INSERT OR REPLACE INTO state (key, value) SELECT ?, CAST(coalesce(max(rowid), 0) AS TEXT) FROM steps",
               [SEARCH_MARK])  # the old triggers indexed every row there is


def _m017_journal_entries(db: sqlite_utils.Database) -> None:
    # Each journal entry the writers committed, by its identity (store/entries.py): the key makes a second
    # commit of the same entry impossible, whatever a writer believes about its position.
    db.execute("CREATE TABLE journal_entries (entry TEXT PRIMARY KEY) WITHOUT ROWID")


MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("capture", _m001_capture),
    ("tokens", _m002_tokens),
    ("linking", _m003_linking),
    ("curation", _m004_curation),
    ("quality_and_search", _m005_quality_and_search),
    ("consumption", _m006_consumption),
    ("runs", _m007_runs),
    ("dashboard", _m008_dashboard),
    ("policy_history", _m009_policy_history),
    ("training", _m010_training),
    ("revocations", _m011_revocations),
    ("consumption_sessions", _m012_consumption_sessions),
    ("doors", _m013_doors),
    ("engine_api", _m014_engine_api),
    ("lean_indexes", _m015_lean_indexes),
    ("search_later", _m016_search_later),
    ("journal_entries", _m017_journal_entries),
]


def pending(db: sqlite_utils.Database) -> list[int]:
    """Versions not applied yet (read without any lock)."""
    if not db["schema_migrations"].exists():
        return list(range(1, len(MIGRATIONS) + 1))
    done = {row[0] for row in db.conn.execute("SELECT version FROM schema_migrations")}
    return [v for v in range(1, len(MIGRATIONS) + 1) if v not in done]


def migrate(db: sqlite_utils.Database) -> int:
    """Apply pending migrations in order, each in its own transaction. Returns the schema version.

    An up-to-date file is only read: opening it never waits for another process's write lock.
    """
    if not pending(db):
        return len(MIGRATIONS)
    if not db["schema_migrations"].exists():
        db["schema_migrations"].create({"version": int, "name": str, "applied_at": str}, pk="version", if_not_exists=True)
    conn = db.conn
    for version, (name, apply) in enumerate(MIGRATIONS, start=1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            done = conn.execute("SELECT 1 FROM schema_migrations WHERE version = ?", [version]).fetchone()
            if not done:
                apply(db)
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                    [version, name, _dt.datetime.now(_dt.UTC).isoformat()],
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return len(MIGRATIONS)
