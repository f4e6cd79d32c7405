"""Recording steps: linking each to its trajectory, parent and group, and storing it as a delta.

Also the small lookups that name a step by what else is known of it (its upstream response id,
its trajectory's latest step).
"""

from __future__ import annotations

import sqlite3

from stepmill.errors import BadInput, NotFound
from stepmill.protocols import messages as linking
from stepmill.store import curation
from stepmill.store.assign import ensure_trajectory, find_parent
from stepmill.store.blobs import Blobs
from stepmill.store.connection import Transactions
from stepmill.store.encoding import clean, dumps, float_column, int_column, packed, text_column
from stepmill.store.history import History
from stepmill.store.ids import new_id, now_iso
from stepmill.store.records import StepRecord, check_record
from stepmill.store.sequences import split_against
from stepmill.store.token_ids import TokenIds

STATUSES = ("ok", "error", "incomplete")
SUMMARY_FIELDS = ("step_id", "trajectory_id", "group_id", "parent_step_id", "step_index", "consistency",
                  "divergence_pos", "divergence_reason")


class Steps:
    """Write steps (alone, or many in one ``batch()``) and find them. A step is stored as deltas on its
    parent's conversation (``history``) and token ids (``token_ids``), its request once (``blobs``)."""

    def __init__(self, tx: Transactions, blobs: Blobs, history: History, token_ids: TokenIds):
        self.tx = tx
        self.blobs = blobs
        self.history = history
        self.token_ids = token_ids

    def record_step(self, rec: StepRecord) -> str:
        """Write one step; assigns trajectory, group, parent and index. Returns the step id."""
        return self.record_steps([rec])[0]

    def record_steps(self, records: list[StepRecord]) -> list[str]:
        """Write several steps in one transaction: all of them or none (the choices of an n > 1 call)."""
        for rec in records:
            if rec.status not in STATUSES:
                raise BadInput(f"status must be one of {', '.join(STATUSES)}, not {rec.status!r}")
        if not self.tx.in_batch:  # on its own: a batch of one
            with self.tx.batch():
                return self.record_steps(records)
        cached: list = []
        with self.tx.savepoint("record_steps") as conn:  # inside a batch: a failure undoes only this call
            ids = [self._insert_step(conn, rec, cached) for rec in records]
        self.tx.cache_when_committed(cached)
        return ids

    def _insert_step(self, conn: sqlite3.Connection, rec: StepRecord, cached: list) -> str:
        notes = check_record(rec)  # odd values an agent or engine sent become notes, never a failed write
        messages = clean(rec.messages or [])
        completion = clean(rec.completion) if isinstance(rec.completion, dict) else None
        wire_messages = list(rec.wire_messages or [])
        wire_completion = list(rec.wire_completion or [])
        step_id = new_id("s")
        continuation = messages + ([completion] if completion else [])
        keys = linking.rolling_keys(continuation)  # keys[k] identifies continuation[:k+1]
        unsystematic = linking.without_system(continuation)
        loose = keys if len(unsystematic) == len(continuation) else linking.rolling_keys(unsystematic)
        loose_message_keys = loose[: len(linking.without_system(messages))]
        system_hash = linking.system_hash(messages)
        explicit = rec.trajectory_id or rec.session_id
        parent = find_parent(conn, rec, explicit, keys[: len(messages)], loose_message_keys)
        minted = False  # a trajectory id made just now: no run or step has it yet, nothing to look up
        if rec.trajectory_id:
            trajectory_id, source = rec.trajectory_id, "explicit"
        elif rec.session_id:
            trajectory_id, source = rec.session_id, "session"
        elif parent:
            trajectory_id, source = parent.trajectory_id, "chain" if rec.previous_response_id else "conversation"
        else:
            trajectory_id, source, minted = new_id("t"), "conversation", True
        if source != "explicit" and not minted and conn.execute(
                "SELECT 1 FROM run_credentials WHERE trajectory_id = ? LIMIT 1", [trajectory_id]).fetchone():
            # A registered run is written only by calls the proxy admitted with its secret: a session
            # id or a continued conversation naming it starts a trajectory of its own instead.
            trajectory_id, source, parent, minted = new_id("t"), "conversation", None, True
        if parent and parent.trajectory_id != trajectory_id:
            parent = None  # a chain into another trajectory is not this trajectory's history
        traj = ensure_trajectory(
            conn, trajectory_id, group_id=rec.group_id or linking.prompt_group_key(messages),
            channel=text_column(rec.channel), default_channel=text_column(rec.default_channel), source=source,
            policy_version=text_column(rec.policy_version), created_at=now_iso(), minted=minted,
        )
        step_index = int_column(rec.step_index)
        if step_index is None and minted:
            step_index = 0
        elif step_index is None:
            step_index = conn.execute(
                "SELECT coalesce(max(step_index) + 1, 0) FROM steps WHERE trajectory_id = ?", [trajectory_id]
            ).fetchone()[0]
        parent_id = parent.id if parent else None
        system_changed = None
        if parent is not None:
            system_changed = int(system_hash != parent.system_hash)
            if system_changed:
                notes.append("the system prompt differs from the parent step's")
        messages_base_len, messages_suffix = split_against(messages, self.history.continued(parent_id, "messages"))
        wire_base_len, wire_suffix = split_against(wire_messages, self.history.continued(parent_id, "wire"))
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
            "engine_api": text_column(rec.engine_api),
            "transport": text_column(rec.transport),
            "host": text_column(rec.host),
            "path": text_column(rec.path),
            "model": text_column(rec.model),
            "response_id": text_column(rec.response_id),
            "request_hash": self.blobs.put(conn, clean({"params": rec.params, "tools": rec.tools})),
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
            "headers_hash": self.blobs.put(conn, clean(rec.headers) if rec.headers else None),
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
        row.update(self.token_ids.token_columns(parent_id, rec.prompt_ids, rec.response_ids, rec.logprobs,
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

    # -- lookups --------------------------------------------------------------------------
    def step_for_response(self, response_id: str) -> str | None:
        """The newest step that answered with this upstream response id (chatcmpl-…, msg_…, resp_…)."""
        row = self.tx.conn.execute("SELECT id FROM steps WHERE response_id = ? ORDER BY rowid DESC LIMIT 1",
                                   [response_id]).fetchone()
        return row[0] if row else None

    def trajectory_of_step(self, step_id: str) -> str | None:
        row = self.tx.conn.execute("SELECT trajectory_id FROM steps WHERE id = ?", [step_id]).fetchone()
        return row[0] if row else None

    def last_step(self, trajectory_id: str) -> str | None:
        """The trajectory's latest step: highest index, then latest written."""
        row = self.tx.conn.execute(
            "SELECT id FROM steps WHERE trajectory_id = ? ORDER BY step_index DESC, rowid DESC LIMIT 1",
            [trajectory_id]).fetchone()
        return row[0] if row else None

    def step_ids(self, trajectory_id: str) -> list[str]:
        """Ids of the trajectory's steps."""
        return [row[0] for row in self.tx.conn.execute("SELECT id FROM steps WHERE trajectory_id = ?",
                                                       [trajectory_id])]

    def step_summary(self, step_id: str) -> dict:
        """Where a step landed: its trajectory, group, parent and index, and whether its ids continue the
        parent's (``consistency``, ``divergence_pos``, ``divergence_reason``)."""
        row = self.tx.conn.execute(
            "SELECT id, trajectory_id, group_id, parent_step_id, step_index, consistency, divergence_pos,"
            " divergence_reason FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise NotFound(step_id)
        return dict(zip(SUMMARY_FIELDS, row))
