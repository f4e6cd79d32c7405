"""Ordered schema migrations. Append new ones; never edit one that has shipped."""

from __future__ import annotations

import datetime as _dt
from typing import Callable

import sqlite_utils


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


MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("capture", _m001_capture),
    ("tokens", _m002_tokens),
    ("linking", _m003_linking),
    ("curation", _m004_curation),
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
