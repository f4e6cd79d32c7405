"""Secrets handed out once and kept only as their hash: the runner's per-run secrets and the UI's
reviewer tokens. One SHA-256 of a short secret: cheap enough for the event loop."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_secret() -> str:
    """A fresh secret, base64url: it needs no escaping in a tagged path or a URL."""
    return secrets.token_urlsafe(24)


def secret_hash(secret: str) -> str:
    """What is stored of a secret."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def secret_matches(secret: str | None, stored_hash: str) -> bool:
    """Whether ``secret`` is the one ``stored_hash`` was made from (compared in constant time)."""
    return bool(secret) and hmac.compare_digest(secret_hash(secret), stored_hash)
