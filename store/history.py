"""Conversations rebuilt from the prefix-shared rows, through the connection's cache.

A step stores only what it adds to its parent's history (see ``store/sequences.py``); reading it
walks up the parent links to the nearest ancestor already cached, so reading a trajectory step by
step costs one delta per step. Token ids are rebuilt the same way (``store/token_ids.py``), over
``History.chain``.
"""

from __future__ import annotations

from typing import Any

from stepmill.errors import NotFound
from stepmill.store.connection import Transactions
from stepmill.store.encoding import loads

# kind -> (the column of how much of the parent's history a step keeps, what it adds, its own tail)
_COLUMNS = {
    "messages": ("messages_base_len", "messages_suffix", "completion"),
    "wire": ("wire_base_len", "wire_suffix", "wire_completion"),
}


class History:
    """Continuations, conversations and wire messages of steps, read through ``tx.cache``."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def chain(self, kind: str, step_id: str, base_col: str, *cols: str) -> tuple[Any, list[dict]]:
        """The rows a ``kind`` sequence of ``step_id`` is rebuilt from, root first.

        The walk up the parent links stops where a delta shares nothing with its parent; the rebuild
        starts from the nearest ancestor already in the cache (in capture order, usually the parent),
        returned first, so reading a trajectory step by step costs one delta per step.
        """
        ids = [row[0] for row in self.tx.conn.execute(f"""
            WITH RECURSIVE chain(id, depth) AS (
                SELECT id, 0 FROM steps WHERE id = :id
                UNION ALL
                SELECT s.parent_step_id, chain.depth + 1 FROM steps s JOIN chain ON s.id = chain.id
                WHERE s.parent_step_id IS NOT NULL AND coalesce(s.{base_col}, 0) > 0
            )
            SELECT id FROM chain ORDER BY depth DESC""", {"id": step_id})]
        if not ids:
            raise NotFound(step_id)
        start, value = 0, None
        for i in range(len(ids) - 2, -1, -1):
            cached = self.tx.cache.get((kind, ids[i]))
            if cached is not None:
                start, value = i + 1, cached
                break
        needed = ids[start:]
        wanted = ", ".join(("id", base_col, *cols))
        rows = {row["id"]: row for row in self.tx.query(
            f"SELECT {wanted} FROM steps WHERE id IN ({','.join('?' * len(needed))})", needed)}
        return value, [rows[i] for i in needed]

    def continued(self, step_id: str | None, kind: str) -> list | None:
        """What a child of ``step_id`` continues (``kind`` "messages": conversation + completion, "wire":
        the wire messages + wire completion); the cached list itself, for the caller to read only."""
        if step_id is None:
            return None
        key = (kind, step_id)
        if key in self.tx.cache:
            return self.tx.cache[key]
        base_col, suffix_col, tail_col = _COLUMNS[kind]
        value, rows = self.chain(kind, step_id, base_col, suffix_col, tail_col)
        value = value or []
        for row in rows:
            tail = loads(row[tail_col])
            value = value[: row[base_col] or 0] + (loads(row[suffix_col]) or [])
            if tail:
                value = value + ([tail] if kind == "messages" else list(tail))
        self.tx.cache.put(key, value)
        return value

    def continuation(self, step_id: str) -> tuple[list[dict], list]:
        """What a child of this step continues: canonical and wire conversation, completion included."""
        return list(self.continued(step_id, "messages")), list(self.continued(step_id, "wire"))

    def messages(self, step_id: str) -> list[dict]:
        """The full canonical conversation a step was prompted with."""
        row = self.tx.conn.execute("SELECT message_count FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise NotFound(step_id)
        return list(self.continued(step_id, "messages")[: row[0]])

    def wire_messages(self, step_id: str) -> list:
        row = self.tx.conn.execute("SELECT wire_completion FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise NotFound(step_id)
        full = self.continued(step_id, "wire")
        tail = len(loads(row[0]) or [])
        return list(full[: len(full) - tail])
