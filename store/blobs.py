"""Content-addressed JSON bodies (request parameters and tools, headers) stored once however often used."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from typing import Any

from stepmill.store.connection import Transactions


class Blobs:
    """Put and read ``blobs`` rows by hash (reads go through ``tx.cache``)."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    @staticmethod
    def put(conn: sqlite3.Connection, value: Any) -> str | None:
        """Store ``value`` in the caller's transaction; its hash (None for None)."""
        if value is None:
            return None
        body = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)
        digest = hashlib.sha256(body.encode()).hexdigest()[:32]
        conn.execute("INSERT OR IGNORE INTO blobs (hash, body) VALUES (?, ?)", [digest, body])
        return digest

    def get(self, digest: str | None) -> Any:
        if digest is None:
            return None
        key = ("blob", digest)
        if key not in self.tx.cache:
            row = self.tx.conn.execute("SELECT body FROM blobs WHERE hash = ?", [digest]).fetchone()
            self.tx.cache.put(key, json.loads(row[0]) if row else None)
        return self.tx.cache[key]
