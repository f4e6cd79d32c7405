"""Conversation keys used to find the step a call continues.

Agents re-send earlier turns in slightly different shapes (an SDK adds null fields, old
thinking is dropped, JSON arguments are re-serialised), so linking compares a loose key per
message: role, visible text, tool calls with parsed arguments, tool call id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable


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
    key = [message.get("role"), content_text(message.get("content")).strip(), calls, message.get("tool_call_id")]
    return json.dumps(key, sort_keys=True, ensure_ascii=False, default=str)


def rolling_keys(messages: Iterable[dict]) -> list[str]:
    """keys[k] identifies messages[:k+1]."""
    digest = hashlib.sha256()
    keys = []
    for message in messages:
        digest.update(message_key(message).encode())
        digest.update(b"\x1e")
        keys.append(digest.copy().hexdigest()[:32])
    return keys


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
