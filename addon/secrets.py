"""What may be stored of a request: an allowlist of headers, and secrets taken out of everything else.

Agents send API keys in headers, URL queries, WebSocket subprotocols and JSON bodies. None of
them may reach the database: headers are kept only by name from a short list, and every text
that is stored raw (bodies of failed steps, errors, parameters) passes through ``redact``.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "[redacted]"

# Request headers worth keeping to tell agents and versions apart. Anything else is dropped.
ALLOWED_HEADERS = frozenset({
    "user-agent", "anthropic-version", "anthropic-beta", "openai-beta", "openai-organization", "openai-project",
    "originator", "version", "x-app", "x-title", "http-referer", "referer",
    "x-stainless-lang", "x-stainless-package-version", "x-stainless-os", "x-stainless-arch",
    "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-helper-method",
    "x-claude-code-session-id", "session_id", "session-id", "x-session-id", "conversation_id",
})

# Field names whose values are credentials, wherever they appear in a JSON body.
SECRET_NAME = re.compile(
    r"^(?:.*[_-])?(?:api[_-]?key|apikey|key|secret|password|passwd|token|access[_-]?token|auth[_-]?token|"
    r"refresh[_-]?token|id[_-]?token|authorization|credentials?|private[_-]?key|subscription[_-]?key)$", re.I)
# A few names above are ordinary request parameters: keep those.
NOT_SECRET = frozenset({"prompt_cache_key", "cache_key", "idempotency_key", "max_tokens", "key_id"})

# Credential shapes, found in any text: provider keys, bearer tokens, OpenAI's browser WebSocket key.
_SHAPES = re.compile(
    rb"\b(?:sk|pk|rk)-(?:ant-|proj-|live-|test-|or-v1-)?[A-Za-z0-9_\-]{6,}"
    rb"|openai-insecure-api-key\.[^\s,;\"']+"
    rb"|\b(?:Bearer|Basic)\s+(?=[A-Za-z0-9_\-\.=:+/]*[0-9=])[A-Za-z0-9_\-\.=:+/]{12,}"
    rb"|\bAKIA[0-9A-Z]{16}\b|\bAIza[0-9A-Za-z_\-]{30,}|\bgh[pousr]_[A-Za-z0-9]{20,}|\bxox[abprs]-[A-Za-z0-9\-]{10,}"
    rb"|\bhf_[A-Za-z0-9]{20,}"
)
# "name": "value" pairs in JSON text whose name is a secret's.
_JSON_PAIR = re.compile(rb'("([A-Za-z0-9_\-]{1,64})"\s*:\s*")((?:[^"\\]|\\.)*)(")')
# name=value in URL queries and form bodies.
_QUERY_PAIR = re.compile(rb"([?&;]([A-Za-z0-9_\-]{1,64})=)([^&#\s\"']*)")


def _is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.match(name)) and name.lower() not in NOT_SECRET


def _pair(match: re.Match) -> bytes:
    name = match.group(2).decode("ascii", "replace")
    if not _is_secret_name(name) or match.group(3) == REDACTED.encode():
        return match.group(0)
    return match.group(1) + REDACTED.encode() + (match.group(4) if match.lastindex >= 4 else b"")


def redact_bytes(data: bytes | None) -> bytes | None:
    """Raw bytes (a body, a frame) with credentials replaced."""
    if not data:
        return data
    data = _JSON_PAIR.sub(_pair, data)
    data = _QUERY_PAIR.sub(_pair, data)
    return _SHAPES.sub(REDACTED.encode(), data)


def redact_text(text: str | None) -> str | None:
    if not text:
        return text
    return redact_bytes(text.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")


def redact_json(value: Any) -> Any:
    """A parsed JSON value with secret-named fields replaced and credential shapes taken out of strings."""
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and _is_secret_name(k) and v not in (None, "")
                else redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def stored_headers(headers) -> dict:
    """The request headers a step keeps: allowlisted names, values cleaned of credential shapes."""
    return {k.lower(): redact_text(v) for k, v in headers.items() if k.lower() in ALLOWED_HEADERS}
