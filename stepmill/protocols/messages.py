"""Conversation keys used to find the step a call continues.

Agents re-send earlier turns in slightly different shapes (an SDK adds null fields, old
thinking is dropped, JSON arguments are re-serialised), so linking compares a loose key per
message: role, visible text, tool calls with parsed arguments, tool call id.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable

# Per-request content agents put in system prompts (Claude Code's billing header with a hash of
# the request, dates, ids): masked before keys are computed, so a conversation keeps its key.
_VOLATILE_LINES = re.compile(r"^\s*x-anthropic-billing-header:.*$", re.I | re.M)
_VOLATILE = re.compile(
    r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b"  # dates, times
    r"|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"  # UUIDs
    r"|\b(?=[0-9a-f]*\d)[0-9a-f]{12,}\b",  # hashes, request ids
    re.I,
)


def stable_system_text(text: str) -> str:
    """System text with volatile per-request parts masked."""
    return _VOLATILE.sub("<v>", _VOLATILE_LINES.sub("", text)).strip()


def content_text(content: Any) -> str:
    """The visible text of a canonical content value (string or list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                parts.append(str(part.get("text") or part.get("content") or ""))
            else:
                parts.append(str(part))
        return "".join(parts)
    return str(content)


def _normal_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def message_key(message: dict) -> str:
    calls = [
        [
            (call.get("function") or {}).get("name"),
            _normal_arguments((call.get("function") or {}).get("arguments")),
        ]
        for call in message.get("tool_calls") or []
    ]
    text = content_text(message.get("content")).strip()
    if message.get("role") == "system":
        text = stable_system_text(text)
    key = [message.get("role"), text, calls, message.get("tool_call_id")]
    return json.dumps(key, sort_keys=True, ensure_ascii=False, default=str)


def rolling_keys(messages: Iterable[dict]) -> list[str]:
    """keys[k] identifies messages[:k+1]."""
    digest = hashlib.sha256()
    keys = []
    for message in messages:
        digest.update(message_key(message).encode("utf-8", "surrogatepass"))
        digest.update(b"\x1e")
        keys.append(digest.copy().hexdigest()[:32])
    return keys


def without_system(messages: Iterable[dict]) -> list[dict]:
    return [m for m in messages if m.get("role") != "system"]


def system_hash(messages: Iterable[dict]) -> str | None:
    """A hash of the system prompt exactly as sent (None without one): tells when it changed."""
    texts = [content_text(m.get("content")) for m in messages if m.get("role") == "system"]
    if not texts:
        return None
    return hashlib.sha256("\x1e".join(texts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def prompt_group_key(messages: list[dict]) -> str | None:
    """A default GRPO group: runs whose conversations start with the same prompt."""
    upto = []
    for message in messages:
        upto.append(message)
        if message.get("role") == "user":
            break
    if not upto:
        return None
    return "g-" + rolling_keys(upto)[-1][:16]
