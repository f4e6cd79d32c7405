"""Conversations and token ids rebuilt from the prefix-shared rows, with a bounded cache.

A step stores only what it adds to its parent's history (see ``store/sequences.py``); reading it
walks up the parent links to the nearest ancestor already cached, so reading a trajectory step by
step costs one delta per step.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

from stepmill.errors import NotFound
from stepmill.store.encoding import loads


def _approx_bytes(value: Any) -> int:
    """A cheap size estimate: conversations count their text, id arrays their buffer."""
    np = sys.modules.get("numpy")  # loaded only once some step carried token ids
    if np is not None and isinstance(value, np.ndarray):
        return value.nbytes + 100
    if isinstance(value, str):
        return len(value) + 50
    if isinstance(value, dict):
        return 100 + sum(_approx_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return 60 + sum(_approx_bytes(v) for v in value)
    return 30


class LRU(OrderedDict):
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


class History:
    """Continuations, conversations and wire messages of steps; a part of ``Store`` (``self._cache``
    is its ``LRU``)."""

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
            raise NotFound(step_id)
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
            import numpy as np

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
            raise NotFound(step_id)
        return list(self._continuation(step_id, "messages")[: row[0]])

    def wire_messages(self, step_id: str) -> list:
        row = self.db.conn.execute("SELECT wire_completion FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise NotFound(step_id)
        full = self._continuation(step_id, "wire")
        tail = len(loads(row[0]) or [])
        return list(full[: len(full) - tail])
