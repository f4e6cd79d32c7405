"""The step store: one SQLite file, WAL mode, shared by the proxy, Datasette and the trainers."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import sqlite3
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from stepmill.store import curation

from stepmill.pipeline import journal

from stepmill.protocols import messages as linking
from stepmill.store.assign import ensure_trajectory, find_parent, set_trajectory_fields
from stepmill.store.encoding import clean, dumps, float_column, int_column, loads, packed, text_column
from stepmill.store.connection import StoreError, open_database, write_transaction
from stepmill.store.records import StepRecord, check_record
from stepmill.store.sequences import pack_ids, pack_logprobs, split_against, unpack_ids, unpack_logprobs

STATUSES = ("ok", "error", "incomplete")

# Fields of one exported step, in order (the JSONL export and the control API use them).
EXPORT_FIELDS = [
    "step_id", "trajectory_id", "group_id", "parent_step_id", "step_index", "api", "transport", "host",
    "model", "response_id", "messages", "tools", "completion", "finish_reason", "usage", "status", "error",
    "ttft_ms", "duration_ms", "started_at", "channel", "policy_version", "reward",
    "prompt_ids", "response_ids", "logprobs", "token_provenance",
]

__all__ = ["Store", "StoreError", "now_iso", "new_id", "dumps", "loads", "packed", "EXPORT_FIELDS"]


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


def _approx_bytes(value: Any) -> int:
    """A cheap size estimate: conversations count their text, id arrays their buffer."""
    if isinstance(value, np.ndarray):
        return value.nbytes + 100
    if isinstance(value, str):
        return len(value) + 50
    if isinstance(value, dict):
        return 100 + sum(_approx_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return 60 + sum(_approx_bytes(v) for v in value)
    return 30


class _LRU(OrderedDict):
    """Least recently used first out, bounded by entries and by (estimated) bytes: one 1 MB
    conversation weighs what a thousand small ones do."""

    def __init__(self, size: int, max_bytes: int = 64 * 1024 * 1024):
        super().__init__()
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._sizes: dict = {}

    def put(self, key, value):
        if key in self:
            self.bytes -= self._sizes.get(key, 0)
        self[key] = value
        self._sizes[key] = weight = _approx_bytes(value)
        self.bytes += weight
        self.move_to_end(key)
        while self and (len(self) > self.size or self.bytes > self.max_bytes):
            old, _ = self.popitem(last=False)
            self.bytes -= self._sizes.pop(old, 0)

    def __delitem__(self, key):
        super().__delitem__(key)
        self.bytes -= self._sizes.pop(key, 0)

    def pop(self, key, *default):
        if key in self:
            self.bytes -= self._sizes.pop(key, 0)
        return super().pop(key, *default)


class Store:
    """Read and write step records. Safe to open from several processes at once."""

    def __init__(self, path: str, *, cache_size: int = 512, readonly: bool = False):
        """``readonly``: never write and never wait for the write lock (exports, stats, the UI)."""
        self.path = str(path)
        self.readonly = readonly
        self.db, self.schema_version = open_database(self.path, readonly=readonly)
        self._cache = _LRU(cache_size)
        self._batch: list | None = None
        self._data_version = self.db.conn.execute("PRAGMA data_version").fetchone()[0]

    def close(self) -> None:
        self.db.conn.close()

    # -- transactions -------------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front so concurrent writers queue instead of failing."""
        if self.readonly:
            raise StoreError(f"{self.path} was opened read-only")
        with write_transaction(self.db.conn) as conn:
            yield conn

    def query(self, sql: str, params: Any = ()) -> list[dict]:
        return list(self.db.query(sql, params))

    # -- state --------------------------------------------------------------------------
    def get_state(self, key: str, default: str | None = None) -> str | None:
        row = self.db.conn.execute("SELECT value FROM state WHERE key = ?", [key]).fetchone()
        return row[0] if row else default

    def set_state(self, key: str, value: str | None) -> None:
        """None removes the key."""
        with self.write() as conn:
            if value is None:
                conn.execute("DELETE FROM state WHERE key = ?", [key])
            else:
                conn.execute("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)", [key, value])

    def policy_version(self) -> str | None:
        return self.get_state("policy_version")

    def set_policy_version(self, version: str | int | None) -> None:
        self.set_state("policy_version", None if version is None else str(version))

    # -- blobs ----------------------------------------------------------------------------
    def _put_blob(self, conn: sqlite3.Connection, value: Any) -> str | None:
        if value is None:
            return None
        body = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)
        digest = hashlib.sha256(body.encode()).hexdigest()[:32]
        conn.execute("INSERT OR IGNORE INTO blobs (hash, body) VALUES (?, ?)", [digest, body])
        return digest

    def _blob(self, digest: str | None) -> Any:
        if digest is None:
            return None
        key = ("blob", digest)
        if key not in self._cache:
            row = self.db.conn.execute("SELECT body FROM blobs WHERE hash = ?", [digest]).fetchone()
            self._cache.put(key, json.loads(row[0]) if row else None)
        return self._cache[key]

    # -- trajectories ---------------------------------------------------------------------
    def trajectory(self, trajectory_id: str) -> dict | None:
        rows = self.query("SELECT * FROM trajectories WHERE id = ?", [trajectory_id])
        if not rows:
            return None
        row = rows[0]
        row["metadata"] = loads(row["metadata"])
        row["step_count"] = self.db.conn.execute(
            "SELECT count(*) FROM steps WHERE trajectory_id = ?", [trajectory_id]
        ).fetchone()[0]
        return row

    def start_trajectory(self, *, trajectory_id=None, group_id=None, channel=None, metadata=None) -> dict:
        trajectory_id = trajectory_id or new_id("t")
        with self.write() as conn:
            if conn.execute("SELECT 1 FROM trajectories WHERE id = ?", [trajectory_id]).fetchone():
                raise StoreError(f"trajectory {trajectory_id!r} already exists")
            ensure_trajectory(conn, trajectory_id, group_id=group_id, channel=channel, source="api",
                              metadata=dumps(metadata), policy_version=self.policy_version(), created_at=now_iso())
        return self.trajectory(trajectory_id)

    def update_trajectory(self, trajectory_id: str, *, group_id=None, channel=None, metadata=None) -> dict:
        with self.write() as conn:
            row = conn.execute("SELECT metadata FROM trajectories WHERE id = ?", [trajectory_id]).fetchone()
            if row is None:
                raise KeyError(trajectory_id)
            fields = {k: v for k, v in (("group_id", group_id), ("channel", channel)) if v is not None}
            if fields:
                set_trajectory_fields(conn, trajectory_id, fields)
            if metadata is not None:
                merged = {**(loads(row[0]) or {}), **metadata}
                conn.execute("UPDATE trajectories SET metadata = ? WHERE id = ?", [dumps(merged), trajectory_id])
        return self.trajectory(trajectory_id)

    def complete_trajectory(self, trajectory_id: str, *, reward: float | None = None) -> dict:
        with self.write() as conn:
            if not conn.execute("SELECT 1 FROM trajectories WHERE id = ?", [trajectory_id]).fetchone():
                raise KeyError(trajectory_id)
            conn.execute("UPDATE trajectories SET status = 'complete', completed_at = ? WHERE id = ?",
                         [now_iso(), trajectory_id])
            if reward is not None:
                curation.add_reward(conn, "trajectory", trajectory_id, reward, source="api", name="control API",
                                    created_at=now_iso())
        return self.trajectory(trajectory_id)

    # -- registered runs ----------------------------------------------------------------
    def register_run(self, trajectory_id: str, secret_hash: str) -> dict:
        """The runner's run: its trajectory (which must exist) may now be written only with the secret."""
        with self.write() as conn:
            row = conn.execute("SELECT group_id, channel FROM trajectories WHERE id = ?", [trajectory_id]).fetchone()
            if row is None:
                raise KeyError(trajectory_id)
            cursor = conn.execute(
                "INSERT INTO run_credentials (trajectory_id, group_id, channel, secret_hash, created_at)"
                " VALUES (?, ?, ?, ?, ?)", [trajectory_id, row[0], row[1], secret_hash, now_iso()])
            # A trajectory nobody registered that already sits in this group (written before any run of
            # it was registered) would keep the group open for ever: it moves to a group of its own.
            for (foreign,) in conn.execute(
                    "SELECT id FROM trajectories WHERE group_id = ? AND id NOT IN"
                    " (SELECT trajectory_id FROM run_credentials)", [row[0]]).fetchall() if row[0] else []:
                set_trajectory_fields(conn, foreign, {"group_id": f"{row[0]}~unregistered"})
        return {"rowid": cursor.lastrowid, "trajectory_id": trajectory_id, "group_id": row[0], "channel": row[1],
                "secret_hash": secret_hash}

    def registered_runs(self, after_rowid: int = 0) -> list[dict]:
        """Registrations newer than ``after_rowid``, oldest first (a later one replaces an earlier)."""
        return self.query("SELECT rowid, trajectory_id, group_id, channel, secret_hash FROM run_credentials"
                          " WHERE rowid > ? ORDER BY rowid", [after_rowid])

    def registered_at(self, trajectory_id: str) -> str | None:
        """When the run's latest attempt was registered (its steps start after), or None."""
        row = self.db.conn.execute("SELECT max(created_at) FROM run_credentials WHERE trajectory_id = ?",
                                   [trajectory_id]).fetchone()
        return row[0] if row else None

    # -- scoring fields -------------------------------------------------------------------
    def set_scoring_fields(self, trajectory_id: str, fields: dict) -> None:
        with self.write() as conn:
            conn.execute("INSERT OR REPLACE INTO scoring_fields (trajectory_id, fields) VALUES (?, ?)",
                         [trajectory_id, dumps(fields)])

    def scoring_fields(self, trajectory_id: str) -> dict:
        row = self.db.conn.execute("SELECT fields FROM scoring_fields WHERE trajectory_id = ?",
                                   [trajectory_id]).fetchone()
        return (loads(row[0]) or {}) if row else {}

    # -- curation -------------------------------------------------------------------------
    def add_reward(self, target: str, value: float, *, source: str = "api", name: str | None = None,
                   note: str | None = None, details: Any = None, idempotency_key: str | None = None) -> dict:
        """Append a reward to a step, a trajectory, or the step of an upstream response id.
        KeyError for an unknown id. The row comes back with ``new`` False for a repeated idempotency key."""
        with self.write() as conn:
            kind, target_id = curation.resolve_target(conn, target)
            row, new = curation.add_reward(conn, kind, target_id, float(value), source=source, name=name, note=note,
                                           details=dumps(details), idempotency_key=idempotency_key,
                                           created_at=now_iso())
        return {**row, "new": new}

    def add_review(self, target: str, action: str, value: str | None = None, *, reviewer: str) -> dict:
        """Append a review action (label, trainable, tag, note) to a step or trajectory. KeyError if unknown."""
        with self.write() as conn:
            kind, target_id = curation.resolve_target(conn, target)
            return curation.add_review(conn, kind, target_id, action, value, reviewer=reviewer, created_at=now_iso())

    def curation(self, target: str) -> dict:
        """A target's reward history, effective reward, review history and current review state."""
        conn = self.db.conn
        kind, target_id = curation.resolve_target(conn, target)
        return {
            "target_kind": kind, "target_id": target_id,
            "reward": curation.effective_reward(conn, kind, target_id),
            "rewards": self.query("SELECT * FROM rewards WHERE target_kind = ? AND target_id = ? ORDER BY id",
                                  [kind, target_id]),
            "review": curation.review_state(conn, kind, target_id),
            "reviews": self.query("SELECT * FROM reviews WHERE target_kind = ? AND target_id = ? ORDER BY id",
                                  [kind, target_id]),
        }

    def gate_counts(self, where: str | None = None, params: Any = ()) -> dict:
        """How many of the selected steps the curation gate keeps, and why it removes the others."""
        sql = f"SELECT {curation.GATE_REASON} AS reason, count(*) FROM steps s"
        if where:
            sql += f" WHERE {where}"
        counts = {reason: n for reason, n in self.db.conn.execute(sql + " GROUP BY 1", params)}
        kept = counts.pop(None, 0)
        return {"kept": kept, "removed": sum(counts.values()), "removed_by_reason": counts}

    # -- recording ------------------------------------------------------------------------
    def record_step(self, rec: StepRecord) -> str:
        """Write one step; assigns trajectory, group, parent and index. Returns the step id."""
        return self.record_steps([rec])[0]

    def record_steps(self, records: list[StepRecord]) -> list[str]:
        """Write several steps in one transaction: all of them or none (the choices of an n > 1 call)."""
        for rec in records:
            if rec.status not in STATUSES:
                raise StoreError(f"status must be one of {', '.join(STATUSES)}, not {rec.status!r}")
        if self._batch is None:  # on its own: a batch of one
            with self.batch():
                return self.record_steps(records)
        conn = self.db.conn  # inside a batch: one savepoint, so a failure undoes only this call
        conn.execute("SAVEPOINT record_steps")
        cached: list = []
        try:
            ids = [self._insert_step(conn, rec, cached) for rec in records]
        except BaseException:
            conn.execute("ROLLBACK TO record_steps")
            conn.execute("RELEASE record_steps")
            raise
        conn.execute("RELEASE record_steps")
        self._batch.extend(cached)
        return ids

    @contextmanager
    def batch(self) -> Iterator[sqlite3.Connection]:
        """One write transaction around many ``record_steps`` calls (the writer commits in batches)."""
        self._batch = []
        try:
            with self.write() as conn:
                yield conn
            for key, value in self._batch:
                self._cache.put(key, value)
        finally:
            self._batch = None

    def _insert_step(self, conn: sqlite3.Connection, rec: StepRecord, cached: list) -> str:
        notes = check_record(rec)  # odd values an agent or engine sent become notes, never a failed write
        messages = clean(rec.messages or [])
        completion = clean(rec.completion) if isinstance(rec.completion, dict) else None
        wire_messages = list(rec.wire_messages or [])
        wire_completion = list(rec.wire_completion or [])
        step_id = new_id("s")
        continuation = messages + ([completion] if completion else [])
        keys = linking.rolling_keys(continuation)  # keys[k] identifies continuation[:k+1]
        loose = linking.rolling_keys(linking.without_system(continuation))
        loose_message_keys = loose[: len(linking.without_system(messages))]
        system_hash = linking.system_hash(messages)
        explicit = rec.trajectory_id or rec.session_id
        parent = find_parent(conn, rec, explicit, keys[: len(messages)], loose_message_keys)
        if rec.trajectory_id:
            trajectory_id, source = rec.trajectory_id, "explicit"
        elif rec.session_id:
            trajectory_id, source = rec.session_id, "session"
        elif parent:
            trajectory_id, source = parent.trajectory_id, "chain" if rec.previous_response_id else "conversation"
        else:
            trajectory_id, source = new_id("t"), "conversation"
        if source != "explicit" and conn.execute("SELECT 1 FROM run_credentials WHERE trajectory_id = ? LIMIT 1",
                                                 [trajectory_id]).fetchone():
            # A registered run is written only by calls the proxy admitted with its secret: a session
            # id or a continued conversation naming it starts a trajectory of its own instead.
            trajectory_id, source, parent = new_id("t"), "conversation", None
        if parent and parent.trajectory_id != trajectory_id:
            parent = None  # a chain into another trajectory is not this trajectory's history
        traj = ensure_trajectory(
            conn, trajectory_id, group_id=rec.group_id or linking.prompt_group_key(messages),
            channel=text_column(rec.channel), default_channel=text_column(rec.default_channel), source=source,
            policy_version=text_column(rec.policy_version), created_at=now_iso(),
        )
        step_index = int_column(rec.step_index)
        if step_index is None:
            step_index = conn.execute(
                "SELECT coalesce(max(step_index) + 1, 0) FROM steps WHERE trajectory_id = ?", [trajectory_id]
            ).fetchone()[0]
        parent_id = parent.id if parent else None
        system_changed = None
        if parent is not None:
            system_changed = int(system_hash != parent.system_hash)
            if system_changed:
                notes.append("the system prompt differs from the parent step's")
        messages_base_len, messages_suffix = split_against(messages, self._continuation(parent_id, "messages"))
        wire_base_len, wire_suffix = split_against(wire_messages, self._continuation(parent_id, "wire"))
        usage = rec.usage if isinstance(rec.usage, dict) else {}
        metadata = dict(rec.metadata) if isinstance(rec.metadata, dict) else {}
        if notes:
            metadata["notes"] = list(metadata.get("notes") or []) + notes
        row = {
            "id": step_id,
            "trajectory_id": trajectory_id,
            "group_id": traj["group_id"],
            "parent_step_id": parent_id,
            "step_index": step_index,
            "api": text_column(rec.api),
            "transport": text_column(rec.transport),
            "host": text_column(rec.host),
            "path": text_column(rec.path),
            "model": text_column(rec.model),
            "response_id": text_column(rec.response_id),
            "request_hash": self._put_blob(conn, clean({"params": rec.params, "tools": rec.tools})),
            "message_count": len(messages),
            "messages_base_len": messages_base_len,
            "messages_suffix": dumps(list(messages_suffix)),
            "wire_base_len": wire_base_len,
            "wire_suffix": packed(clean(list(wire_suffix))),
            "completion": dumps(completion),
            "wire_completion": packed(clean(wire_completion)),
            "finish_reason": text_column(rec.finish_reason),
            "usage": dumps(clean(usage.get("raw", usage)) if usage else None),  # normalised counts have columns
            "input_tokens": int_column(usage.get("input_tokens")),
            "output_tokens": int_column(usage.get("output_tokens")),
            "cache_read_tokens": int_column(usage.get("cache_read_tokens")),
            "cache_write_tokens": int_column(usage.get("cache_write_tokens")),
            "status": rec.status,
            "error": text_column(rec.error),
            "http_status": int_column(rec.http_status),
            "ttft_ms": float_column(rec.ttft_ms),
            "duration_ms": float_column(rec.duration_ms),
            "started_at": text_column(rec.started_at) or now_iso(),
            "channel": traj["channel"] or "train",
            "policy_version": text_column(rec.policy_version),
            "reward": None,  # effective, set from the rewards table below
            "headers_hash": self._put_blob(conn, clean(rec.headers) if rec.headers else None),
            "link_key": keys[len(messages) - 1] if messages else None,
            "continuation_key": keys[-1] if completion else None,
            "loose_key": loose[-1] if completion and loose else None,
            "system_hash": system_hash,
            "system_changed": system_changed,
            "client_conn": text_column(rec.client_conn),
            "metadata": dumps(clean(metadata) or None),
            "raw_request": rec.raw_request,
            "raw_response": rec.raw_response,
            "token_provenance": "none",
        }
        row.update(self._token_columns(parent_id, rec.prompt_ids, rec.response_ids, rec.logprobs,
                                       rec.token_provenance or "exact", system_changed=bool(system_changed)))
        cols = ",".join(row)
        conn.execute(f"INSERT INTO steps ({cols}) VALUES ({','.join('?' * len(row))})", list(row.values()))
        if float_column(rec.reward) is not None:
            curation.add_reward(conn, "step", step_id, float_column(rec.reward), source="api", name="control API",
                                created_at=now_iso())
        if rec.is_last:
            conn.execute("UPDATE trajectories SET status = 'complete', completed_at = ? WHERE id = ?",
                         [now_iso(), trajectory_id])
        cached.append((("messages", step_id), continuation))
        cached.append((("wire", step_id), wire_messages + wire_completion))
        return step_id

    # -- token ids ------------------------------------------------------------------------
    def _token_columns(self, parent_id, prompt_ids, response_ids, logprobs, provenance, *, spliced_len=None,
                       system_changed: bool = False) -> dict:
        if prompt_ids is None and response_ids is None:
            return {}
        prompt = np.asarray(prompt_ids if prompt_ids is not None else [], dtype=np.int64)
        response = np.asarray(response_ids if response_ids is not None else [], dtype=np.int64)
        if logprobs is not None and len(logprobs) != len(response):
            raise StoreError(f"logprobs has {len(logprobs)} values for {len(response)} response ids")
        base = self._continuation(parent_id, "tokens")
        base_len, suffix = split_against(prompt, base)
        if base is None or not len(base):
            consistency, pos, reason = ("root" if parent_id is None else None), None, None
        elif base_len == len(base):
            consistency, pos, reason = "consistent", None, None
        else:
            consistency, pos = "divergent", base_len
            if base_len == len(prompt):
                reason = f"prompt ends at {len(prompt)} inside the parent's {len(base)} prompt+response ids"
            else:
                reason = (f"token {base_len}: parent sequence has id {int(base[base_len])}, "
                          f"this prompt has id {int(prompt[base_len])}")
            if system_changed:
                reason += " (the system prompt changed since the parent step)"
        return {
            "token_provenance": provenance,
            "prompt_len": len(prompt),
            "prompt_base_len": base_len,
            "prompt_suffix": pack_ids(suffix),
            "response_len": len(response),
            "response_ids": pack_ids(response),
            "logprobs": pack_logprobs(logprobs),
            "spliced_len": spliced_len,
            "consistency": consistency,
            "divergence_pos": pos,
            "divergence_reason": reason,
        }

    def set_tokens(self, step_id: str, prompt_ids, response_ids, logprobs=None, *, provenance: str,
                   tokenizer: str | None = None, spliced_len: int | None = None, fidelity: str | None = None,
                   fidelity_detail: str | None = None, in_transaction: bool = False) -> None:
        """Store ids computed after capture (rendered, spliced); the parent's must already be stored."""
        row = self.db.conn.execute("SELECT parent_step_id, system_changed FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise KeyError(step_id)
        cols = self._token_columns(row[0], prompt_ids, response_ids, logprobs, provenance, spliced_len=spliced_len,
                                   system_changed=bool(row[1]))
        cols.update({"tokenizer": tokenizer, "fidelity": fidelity, "fidelity_detail": fidelity_detail})
        if in_transaction:
            self._update_tokens(step_id, cols)
        else:
            with self.write():
                self._update_tokens(step_id, cols)

    def clear_tokens(self, step_id: str, *, tokenizer: str | None, fidelity: str | None,
                     fidelity_detail: str | None, in_transaction: bool = False) -> None:
        """Remove a step's ids (rendering failed): it has none rather than ids of another tokenizer."""
        cols = {"token_provenance": "none", "prompt_len": None, "prompt_base_len": None, "prompt_suffix": None,
                "response_len": None, "response_ids": None, "logprobs": None, "spliced_len": None,
                "consistency": None, "divergence_pos": None, "divergence_reason": None,
                "tokenizer": tokenizer, "fidelity": fidelity, "fidelity_detail": fidelity_detail}
        if self.db.conn.execute("SELECT 1 FROM steps WHERE id = ?", [step_id]).fetchone() is None:
            raise KeyError(step_id)
        if in_transaction:
            self._update_tokens(step_id, cols)
        else:
            with self.write():
                self._update_tokens(step_id, cols)

    def _update_columns(self, step_id: str, cols: dict) -> None:
        self.db.conn.execute(f"UPDATE steps SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?",
                             [*cols.values(), step_id])

    def _update_tokens(self, step_id: str, cols: dict) -> None:
        conn = self.db.conn
        # Children store their prompt as a delta against this step's ids: rebase them on the new ids, and
        # check again those stored before this step had ids (their consistency was unknown).
        children = {
            child: self.token_sequences(child) for (child,) in conn.execute(
                "SELECT id FROM steps WHERE parent_step_id = ? AND prompt_len IS NOT NULL", [step_id]).fetchall()
        }
        self._update_columns(step_id, cols)
        self._cache.pop(("tokens", step_id), None)
        for child, (prompt, response, logprobs) in children.items():
            provenance, spliced, changed = conn.execute(
                "SELECT token_provenance, spliced_len, system_changed FROM steps WHERE id = ?", [child]).fetchone()
            rebased = self._token_columns(step_id, prompt, response, logprobs, provenance, spliced_len=spliced,
                                          system_changed=bool(changed))
            self._update_columns(child, rebased)
            self._cache.pop(("tokens", child), None)

    def _forget_changed_tokens(self) -> None:
        """Token ids can be re-set (`stepmill tokenize --redo`) by another process: when the file changed
        under us, cached token sequences may be stale. Conversations never change once written."""
        version = self.db.conn.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._data_version = version
            for key in [k for k in self._cache if k[0] == "tokens"]:
                del self._cache[key]

    def token_sequences(self, step_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(prompt_ids, response_ids, logprobs) of one step, rebuilt from the shared prefixes."""
        self._forget_changed_tokens()
        full, rows = self._chain("tokens", step_id, "prompt_base_len", "prompt_suffix", "response_ids", "logprobs",
                                 "prompt_len")
        target = rows[-1]
        if target["prompt_len"] is None:
            return np.zeros(0, np.int32), np.zeros(0, np.int32), None
        full = full if full is not None else np.zeros(0, np.int32)
        for row in rows:
            prompt = np.concatenate([full[: row["prompt_base_len"] or 0], unpack_ids(row["prompt_suffix"])])
            response = unpack_ids(row["response_ids"])
            full = np.concatenate([prompt, response])
        self._cache.put(("tokens", step_id), full)
        return prompt, response, unpack_logprobs(target["logprobs"])

    # -- reading conversations --------------------------------------------------------------
    def _chain(self, kind: str, step_id: str, base_col: str, *cols: str) -> tuple[Any, list[dict]]:
        """The rows a ``kind`` sequence of ``step_id`` is rebuilt from, root first.

        The walk up the parent links stops where a delta shares nothing with its parent; the rebuild
        starts from the nearest ancestor already in the cache (in capture order, usually the parent),
        returned first, so reading a trajectory step by step costs one delta per step.
        """
        ids = [row[0] for row in self.db.conn.execute(f"""
            WITH RECURSIVE chain(id, depth) AS (
                SELECT id, 0 FROM steps WHERE id = :id
                UNION ALL
                SELECT s.parent_step_id, chain.depth + 1 FROM steps s JOIN chain ON s.id = chain.id
                WHERE s.parent_step_id IS NOT NULL AND coalesce(s.{base_col}, 0) > 0
            )
            SELECT id FROM chain ORDER BY depth DESC""", {"id": step_id})]
        if not ids:
            raise KeyError(step_id)
        start, value = 0, None
        for i in range(len(ids) - 2, -1, -1):
            cached = self._cache.get((kind, ids[i]))
            if cached is not None:
                start, value = i + 1, cached
                break
        needed = ids[start:]
        wanted = ", ".join(("id", base_col, *cols))
        rows = {row["id"]: row for row in self.query(
            f"SELECT {wanted} FROM steps WHERE id IN ({','.join('?' * len(needed))})", needed)}
        return value, [rows[i] for i in needed]

    def _continuation(self, step_id: str | None, kind: str):
        """What a child of ``step_id`` continues: conversation + completion, or prompt + response ids."""
        if step_id is None:
            return None
        if kind == "tokens":
            self._forget_changed_tokens()
        key = (kind, step_id)
        if key in self._cache:
            return self._cache[key]
        if kind == "tokens":
            prompt, response, _ = self.token_sequences(step_id)
            value = np.concatenate([prompt, response]) if len(prompt) or len(response) else None
        else:
            base_col, suffix_col, tail_col = {
                "messages": ("messages_base_len", "messages_suffix", "completion"),
                "wire": ("wire_base_len", "wire_suffix", "wire_completion"),
            }[kind]
            value, rows = self._chain(kind, step_id, base_col, suffix_col, tail_col)
            value = value or []
            for row in rows:
                tail = loads(row[tail_col])
                value = value[: row[base_col] or 0] + (loads(row[suffix_col]) or [])
                if tail:
                    value = value + ([tail] if kind == "messages" else list(tail))
        self._cache.put(key, value)
        return value

    def continuation(self, step_id: str) -> tuple[list[dict], list]:
        """What a child of this step continues: canonical and wire conversation, completion included."""
        return list(self._continuation(step_id, "messages")), list(self._continuation(step_id, "wire"))

    def messages(self, step_id: str) -> list[dict]:
        """The full canonical conversation a step was prompted with."""
        row = self.db.conn.execute("SELECT message_count FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise KeyError(step_id)
        return list(self._continuation(step_id, "messages")[: row[0]])

    def wire_messages(self, step_id: str) -> list:
        row = self.db.conn.execute("SELECT wire_completion FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise KeyError(step_id)
        full = self._continuation(step_id, "wire")
        tail = len(loads(row[0]) or [])
        return list(full[: len(full) - tail])

    # -- export ---------------------------------------------------------------------------
    def step(self, step_id: str, *, with_tokens: bool = True) -> dict:
        rows = self.query(
            "SELECT s.*, t.reward AS trajectory_reward FROM steps s"
            " LEFT JOIN trajectories t ON t.id = s.trajectory_id WHERE s.id = ?", [step_id]
        )
        if not rows:
            raise KeyError(step_id)
        return self._export(rows[0], with_tokens=with_tokens)

    def _export(self, row: dict, *, with_tokens: bool = True) -> dict:
        request = self._blob(row["request_hash"]) or {}
        record = {
            "step_id": row["id"],
            "trajectory_id": row["trajectory_id"],
            "group_id": row["group_id"],
            "parent_step_id": row["parent_step_id"],
            "step_index": row["step_index"],
            "api": row["api"],
            "transport": row["transport"],
            "host": row["host"],
            "model": row["model"],
            "response_id": row["response_id"],
            "messages": self.messages(row["id"]),
            "tools": request.get("tools"),
            "completion": loads(row["completion"]),
            "finish_reason": row["finish_reason"],
            "usage": None if row["usage"] is None and row["input_tokens"] is None else {
                "input_tokens": row["input_tokens"], "output_tokens": row["output_tokens"],
                "cache_read_tokens": row["cache_read_tokens"], "cache_write_tokens": row["cache_write_tokens"],
                "raw": loads(row["usage"]),
            },
            "status": row["status"],
            "error": row["error"],
            "ttft_ms": row["ttft_ms"],
            "duration_ms": row["duration_ms"],
            "started_at": row["started_at"],
            "channel": row["channel"],
            "policy_version": row["policy_version"],
            "reward": row["reward"] if row["reward"] is not None else row.get("trajectory_reward"),
            "token_provenance": row["token_provenance"] or "none",
            "prompt_ids": None,
            "response_ids": None,
            "logprobs": None,
        }
        if with_tokens and row["prompt_len"] is not None:
            prompt, response, logprobs = self.token_sequences(row["id"])
            record["prompt_ids"] = prompt.tolist()
            record["response_ids"] = response.tolist()
            record["logprobs"] = None if logprobs is None else [float(x) for x in logprobs]
        record["params"] = request.get("params")
        record["metadata"] = loads(row["metadata"])
        record["system_changed"] = None if row["system_changed"] is None else bool(row["system_changed"])
        record["token_check"] = {
            "consistency": row["consistency"],
            "divergence_pos": row["divergence_pos"],
            "divergence_reason": row["divergence_reason"],
            "spliced_len": row["spliced_len"],
            "fidelity": row["fidelity"],
            "fidelity_detail": row["fidelity_detail"],
            "tokenizer": row["tokenizer"],
        }
        return record

    def iter_steps(self, where: str | None = None, params: Any = (), *, with_tokens: bool = True,
                   gate: bool = False) -> Iterator[dict]:
        """Exported steps in capture order; ``where`` is a SQL condition on the steps table (alias s).
        ``gate``: only what the curation gate lets through (see ``store/curation.py``)."""
        sql = ("SELECT s.*, t.reward AS trajectory_reward FROM steps s"
               " LEFT JOIN trajectories t ON t.id = s.trajectory_id")
        conditions = [f"({where})"] if where else []
        if gate:
            conditions.append(f"({curation.GATE_REASON}) IS NULL")
        if conditions:
            sql += " WHERE " + " AND ".join(conditions)
        sql += " ORDER BY s.started_at, s.rowid"
        for row in self.db.query(sql, params):
            yield self._export(row, with_tokens=with_tokens)

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        conn = self.db.conn

        def counts(column: str) -> dict:
            return {str(k): v for k, v in conn.execute(
                f"SELECT {column}, count(*) FROM steps GROUP BY 1 ORDER BY 2 DESC")}

        total = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
        tokens = conn.execute(
            "SELECT coalesce(sum(input_tokens),0), coalesce(sum(output_tokens),0),"
            " coalesce(sum(cache_read_tokens),0), coalesce(sum(cache_write_tokens),0) FROM steps"
        ).fetchone()
        exact = conn.execute("SELECT count(*) FROM steps WHERE token_provenance = 'exact'").fetchone()[0]
        with_ids = conn.execute("SELECT count(*) FROM steps WHERE prompt_len IS NOT NULL").fetchone()[0]
        checked = conn.execute(
            "SELECT count(*), coalesce(sum(consistency = 'consistent'), 0) FROM steps"
            " WHERE consistency IN ('consistent', 'divergent')"
        ).fetchone()
        return {
            "steps": total,
            "trajectories": conn.execute("SELECT count(*) FROM trajectories").fetchone()[0],
            "groups": conn.execute("SELECT count(DISTINCT group_id) FROM trajectories").fetchone()[0],
            "by_api": counts("api"),
            "by_model": counts("model"),
            "by_status": counts("status"),
            "by_channel": counts("channel"),
            "by_token_provenance": counts("token_provenance"),
            "tokens": {"input": tokens[0], "output": tokens[1], "cache_read": tokens[2], "cache_write": tokens[3]},
            "steps_with_ids": with_ids,
            "exact_id_share": exact / total if total else None,
            "parent_child_pairs_checked": checked[0],
            "consistent_share": checked[1] / checked[0] if checked[0] else None,
            "policy_version": self.policy_version(),
            "journal": journal.backlog(self.path, {k: v for k, v in conn.execute(
                "SELECT key, value FROM state WHERE key LIKE 'journal:%'")}),
        }
