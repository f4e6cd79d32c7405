"""Named reviewer tokens for the UI: shown once when created, kept only as a hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(conn: sqlite3.Connection, name: str, created_at: str) -> str:
    """A new token for ``name`` (replacing any earlier one). Call in a write transaction."""
    token = secrets.token_urlsafe(24)
    conn.execute("INSERT OR REPLACE INTO reviewers (name, token_hash, created_at) VALUES (?, ?, ?)",
                 [name, _hash(token), created_at])
    return token


def who(conn: sqlite3.Connection, token: str) -> str | None:
    """The reviewer a token belongs to, or None."""
    digest = _hash(token or "")
    for name, stored in conn.execute("SELECT name, token_hash FROM reviewers"):
        if hmac.compare_digest(stored, digest):
            return name
    return None
