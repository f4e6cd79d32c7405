"""What may be stored of a request: an allowlist of headers, and secrets taken out of everything else.

Both sides of the event loop: the allowlist applies on the loop (``allowed_headers``, a dict
filter); values are redacted with everything else off it, in the handoff thread before the
journal (``handoff.redact_record``), and in the writer for what it stores raw.

Agents send API keys in headers, URL queries, WebSocket subprotocols and JSON bodies. None of
them may reach the database: headers are kept only by name from a short list, and every text
that is stored raw (bodies of failed steps, errors, parameters) passes through ``redact``.
"""

from __future__ import annotations

import re
import time
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

# Field names whose values are credentials, wherever they appear in a JSON body or a query.
_SECRET_NAME = (r"(?:[A-Za-z0-9_\-]*[_-])?(?:api[_-]?key|apikey|key|secret|password|passwd|token|access[_-]?token|"
                r"auth[_-]?token|refresh[_-]?token|id[_-]?token|authorization|credentials?|private[_-]?key|"
                r"subscription[_-]?key)")
SECRET_NAME = re.compile(f"^{_SECRET_NAME}$", re.I)
# A few names above are ordinary request parameters: keep those.
NOT_SECRET = frozenset({"prompt_cache_key", "cache_key", "idempotency_key", "max_tokens", "key_id"})

# Credential forms, each its own pattern: one led by a literal is a fast scan, an alternation of
# all of them would be slow (a per-byte try of every branch).
_PAIRS = [
    # "name": "value" in JSON, name=value in queries and forms; the name decides
    re.compile(rb'(?P<pre>"(?P<name>' + _SECRET_NAME.encode() + rb')"\s*:\s*")(?P<value>(?:[^"\\]|\\.)*)(?P<post>")', re.I),
    re.compile(rb"(?P<pre>[?&;](?P<name>" + _SECRET_NAME.encode() + rb")=)(?P<value>[^&#\s\"']*)(?P<post>)", re.I),
]
_SHAPES = [re.compile(p) for p in (
    rb"sk-(?:ant-|proj-|live-|test-|or-v1-)?[A-Za-z0-9_\-]{6,}", rb"pk-(?:live-|test-)?[A-Za-z0-9_\-]{6,}",
    rb"rk-(?:live-|test-)?[A-Za-z0-9_\-]{6,}", rb"openai-insecure-api-key\.[^\s,;\"']+",
    rb"Bearer\s+(?=[A-Za-z0-9_\-\.=:+/]*[0-9=])[A-Za-z0-9_\-\.=:+/]{12,}",
    rb"Basic\s+(?=[A-Za-z0-9_\-\.=:+/]*[0-9=])[A-Za-z0-9_\-\.=:+/]{12,}",
    rb"AKIA[0-9A-Z]{16}", rb"AIza[0-9A-Za-z_\-]{30,}", rb"gh[pousr]_[A-Za-z0-9]{20,}", rb"xox[abprs]-[A-Za-z0-9\-]{10,}",
    rb"hf_[A-Za-z0-9]{20,}",
)]
# User-info in a URL (``https://user:password@host``, also JSON-escaped ``https:\/\/``): the credential is
# between the scheme's slashes and an "@" before any "/". Two patterns, each led by a literal (a fast scan).
_USERINFO = [re.compile(rb"(?P<pre>" + slashes + rb")(?P<value>[^/\\\s@\"'<>?#]{1,512})(?P<post>@)")
             for slashes in (rb"://", rb":\\/\\/")]
# The pair patterns are slow on large text (a try at every quote): they run only where one of these
# endings of a secret's name occurs (a substring search on the lower-cased text, memchr-fast).
_PAIR_TRIGGERS = (b'key"', b'secret"', b'password"', b'passwd"', b'token"', b'authorization"', b'credential',
                  b"key=", b"secret=", b"password=", b"passwd=", b"token=", b"authorization=")
# On short text (header values, small bodies) one search for all of them is cheaper than thirteen.
_ANY_TRIGGER = re.compile(b"|".join(re.escape(trigger) for trigger in _PAIR_TRIGGERS))
_SHORT = 1024
_WORD = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
WINDOW = 1 << 18  # large bodies are scanned a window (a few ms) at a time, letting other threads run between


def _is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.match(name)) and name.lower() not in NOT_SECRET


def _pair(match: re.Match) -> bytes:
    if match.group("name").decode().lower() in NOT_SECRET or match.group("value") in (b"", REDACTED.encode()):
        return match.group(0)
    return match.group("pre") + REDACTED.encode() + match.group("post")


def _userinfo(match: re.Match) -> bytes:
    return match.group(0) if match.group("value") == REDACTED.encode() else \
        match.group("pre") + REDACTED.encode() + match.group("post")


def _has_trigger(lowered: bytes) -> bool:
    if len(lowered) < _SHORT:
        return _ANY_TRIGGER.search(lowered) is not None
    for trigger in _PAIR_TRIGGERS:
        if trigger in lowered:
            return True
    return False


def _redact_window(data: bytes) -> bytes:
    if _has_trigger(data.lower()):
        for pattern in _PAIRS:
            data = pattern.sub(_pair, data)
    if b"@" in data:
        for pattern in _USERINFO:
            data = pattern.sub(_userinfo, data)
    for pattern in _SHAPES:
        if pattern.search(data) is None:
            continue

        def shape(match: re.Match, data=data) -> bytes:
            start = match.start()
            if start and data[start - 1] in _WORD:  # inside a longer word ("task-force"): not a key
                return match.group(0)
            return REDACTED.encode()

        data = pattern.sub(shape, data)
    return data


def _found(pattern: re.Pattern, data: bytes) -> bool:
    """Searched a window at a time (with a pause between), overlapping so no match is cut."""
    for start in range(0, len(data), WINDOW):
        if pattern.search(data, start, min(len(data), start + WINDOW + 4096)):
            return True
        time.sleep(0)
    return False


def redact_bytes(data: bytes | bytearray | None) -> bytes | None:
    """Raw bytes (a body, a frame) with credentials replaced.

    A large body is done in windows cut at line or JSON string boundaries (a secret spanning a
    cut is not expected: keys are short), with a pause for other threads between windows, so a
    50 MB body never holds the proxy's GIL in one piece.
    """
    if not data:
        return bytes(data) if data is not None else None
    data = bytes(data)
    if len(data) <= WINDOW:
        return _redact_window(data)
    pairs = _PAIRS if _has_trigger(data.lower()) else []
    if not any(_found(pattern, data) for pattern in pairs + _USERINFO + _SHAPES):
        return data  # nothing to take out: no copy of a large body
    out, start = [], 0
    while start < len(data):
        end = min(len(data), start + WINDOW)
        if end < len(data):  # cut after a comma or newline, never inside a short token
            cut = max(data.rfind(b",", start, end), data.rfind(b"\n", start, end))
            end = cut + 1 if cut > start else end
        out.append(_redact_window(data[start:end]))
        start = end
        time.sleep(0)
    return b"".join(out)


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


def allowed_headers(headers) -> dict:
    """The allowlisted request headers, by name only (cheap enough for the event loop)."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in ALLOWED_HEADERS}

