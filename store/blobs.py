"""Content-addressed JSON bodies (request parameters and tools, headers) stored once however often used."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from typing import Any


class Blobs:
    """Put and read ``blobs`` rows by hash; a part of ``Store`` (reads go through the history cache)."""

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
