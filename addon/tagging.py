"""Which trajectory and group a call belongs to, from what the agent sends.

Explicit tags win: a reverse-mode base URL ``/t/{trajectory}/g/{group}/v1/...``, the
``X-Stepmill-Trajectory`` / ``X-Stepmill-Group`` headers, or proxy credentials
``http://{trajectory}:{group}@host:port``. Next come the agent's own session ids.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from urllib.parse import unquote

TAG_PATH = re.compile(r"^/t/([^/]+)(?:/g/([^/]+))?(/.*)?$")
TRAJECTORY_HEADER = "x-stepmill-trajectory"
GROUP_HEADER = "x-stepmill-group"
CHANNEL_HEADER = "x-stepmill-channel"
SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "session-id", "x-session-id", "conversation_id")


@dataclass
class Tags:
    trajectory_id: str | None = None
    group_id: str | None = None
    channel: str | None = None

    def merge(self, other: "Tags | None") -> "Tags":
        """Fill what this one lacks from ``other``."""
        if other is None:
            return self
        return Tags(self.trajectory_id or other.trajectory_id, self.group_id or other.group_id,
                    self.channel or other.channel)


def split_tag_path(path: str) -> tuple[Tags, str] | None:
    """``/t/T/g/G/v1/x`` -> (Tags(T, G), ``/v1/x``); None when the path carries no tags."""
    found = TAG_PATH.match(path)
    if not found:
        return None
    rest = found.group(3) or "/"
    return Tags(unquote(found.group(1)), unquote(found.group(2)) if found.group(2) else None), rest


def from_proxy_authorization(value: str | None) -> Tags | None:
    """Tags from ``Proxy-Authorization: Basic base64(trajectory:group)``."""
    if not value or not value.lower().startswith("basic "):
        return None
    try:
        user, _, password = base64.b64decode(value[6:].strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if not user:
        return None
    return Tags(unquote(user), unquote(password) or None)


def header_index(headers) -> dict[str, str]:
    """mitmproxy's request headers by lower-cased name, in one pass (each ``headers.get`` is a scan of
    all of them); repeated headers are folded with ", " as ``headers.get`` does."""
    index: dict[str, str] = {}
    for name, value in headers.fields:
        key = name.decode("latin-1").lower()
        text = value.decode("utf-8", "surrogateescape")
        index[key] = f"{index[key]}, {text}" if key in index else text
    return index


def pop_header_tags(headers, index: dict[str, str]) -> Tags | None:
    """Tags from the X-Stepmill-* headers, which are removed before the request goes upstream."""
    names = (TRAJECTORY_HEADER, GROUP_HEADER, CHANNEL_HEADER)
    values = [index.get(name) for name in names]
    if not any(name in index for name in names):
        return None
    for name in names:
        headers.pop(name, None)
    return Tags(*values) if any(values) else None


def session_id(index: dict[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        if index.get(name):
            return index[name]
    return None
