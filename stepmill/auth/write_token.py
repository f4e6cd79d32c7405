"""The write token: what the control API asks of every caller but health checks.

Agents reach the proxy, so the proxy cannot trust a caller for being able to reach it. The
token is created on first start in mitmproxy's confdir, readable by its owner only, and read
from there by `stepmill` and `StepmillClient` on the same machine. ``STEPMILL_TOKEN`` set in
the environment wins everywhere: set when starting the proxy, it fixes the token for a
deployment; set for a trainer or an app, it is what they send. Agents are never given it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

ENV = "STEPMILL_TOKEN"
FILENAME = "stepmill-token"
DEFAULT_CONFDIR = "~/.mitmproxy"


def token_path(confdir: str | None = None) -> Path:
    return Path(os.path.expanduser(confdir or DEFAULT_CONFDIR)) / FILENAME


def read_token(confdir: str | None = None) -> str | None:
    """The token a client sends: ``STEPMILL_TOKEN``, else the confdir's file, else None."""
    if os.environ.get(ENV):
        return os.environ[ENV].strip()
    try:
        return token_path(confdir).read_text().strip() or None
    except OSError:
        return None


def token_wanted(whose: str, confdir: str | None = None) -> str:
    """What a client that waits for the token lacks, and where it will come from (``Waiting``'s words)."""
    return f"{whose} write token ({token_path(confdir)}, made by the rollout; or {ENV})"


def ensure_token(confdir: str | None = None) -> str:
    """The proxy's token: ``STEPMILL_TOKEN``, else the confdir's file, created (mode 0600) if missing."""
    if os.environ.get(ENV):
        return os.environ[ENV].strip()
    path = token_path(confdir)
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token`` as a bearer token (compared in constant time)."""
    scheme, _, value = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
