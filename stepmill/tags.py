"""Which trajectory and group a call belongs to, from what the agent sends — the one place the tag
grammar is written, parsed and formatted.

Explicit tags: a reverse-mode base URL ``/t/{trajectory}/g/{group}/v1/...``, proxy credentials
``http://{trajectory}:{group}@host:port``, and the ``X-Stepmill-Trajectory`` / ``X-Stepmill-Group``
/ ``X-Stepmill-Channel`` headers. Credentials and the path win over headers, which only fill
what they lack. A run the rollout runner registered carries a secret instead of its group
(``http://{trajectory}:{secret}@…``, ``/t/{trajectory}/k/{secret}/v1``); see ``stepmill/auth/runs.py``.
Next come the agent's own session ids.

Ids travel as **tokens** that need no escaping anywhere (URL user-info, path segments, header
values), so a client that percent-decodes its proxy URL and one that does not send the same
bytes: an id of ``[A-Za-z0-9_-][A-Za-z0-9._-]*`` is its own token, any other id is ``~`` and
its UTF-8 in unpadded base64url. A token with ``%`` in it was written by hand and is
percent-decoded.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from urllib.parse import unquote

TAG_PATH = re.compile(r"^/t/([^/]+)(?:/([gk])/([^/]+))?(/.*)?$")
PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
BASE64URL = re.compile(r"[A-Za-z0-9_-]+")
TRAJECTORY_HEADER = "x-stepmill-trajectory"
GROUP_HEADER = "x-stepmill-group"
CHANNEL_HEADER = "x-stepmill-channel"
SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "session-id", "x-session-id", "conversation_id")


@dataclass
class Tags:
    trajectory_id: str | None = None
    group_id: str | None = None
    channel: str | None = None
    secret: str | None = None  # a credential's password or a path's key, as sent; never stored

    def merge(self, other: "Tags | None") -> "Tags":
        """Fill what this one lacks from ``other``."""
        if other is None:
            return self
        return Tags(self.trajectory_id or other.trajectory_id, self.group_id or other.group_id,
                    self.channel or other.channel, self.secret or other.secret)


# -- ids as tokens ----------------------------------------------------------------------------
def encode_id(value: str) -> str:
    if PLAIN_ID.fullmatch(value):
        return value
    return "~" + base64.urlsafe_b64encode(value.encode("utf-8")).rstrip(b"=").decode("ascii")


def decode_id(token: str) -> str:
    """The id a token stands for; ValueError for a ``~`` token that is not base64url of UTF-8, or a token that
    is not UTF-8 itself (a header's bytes arrive surrogate-escaped)."""
    if token.startswith("~"):
        body = token[1:]
        if not BASE64URL.fullmatch(body):
            raise ValueError(f"{token!r} is not an encoded id")
        try:
            return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ValueError(f"{token!r} is not an encoded id: {exc}") from None
    value = unquote(token, errors="strict") if "%" in token else token
    if not value.isascii():
        value.encode("utf-8")  # UnicodeEncodeError (a ValueError): header bytes that were not UTF-8
    return value


def _decoded_or_none(token: str | None) -> str | None:
    if not token:
        return None
    try:
        return decode_id(token) or None
    except (ValueError, UnicodeDecodeError):
        return None


# -- formatting ---------------------------------------------------------------------------------
def credentials(trajectory: str, group: str | None = None, secret: str | None = None) -> str:
    """``user:password`` for a proxy URL: the trajectory, and the run's secret or else its group."""
    password = secret if secret else (encode_id(group) if group else "")
    return encode_id(trajectory) + (":" + password if password else "")


def proxy_url(host: str, port: int, trajectory: str | None = None, group: str | None = None,
              secret: str | None = None, scheme: str = "http") -> str:
    auth = credentials(trajectory, group, secret) + "@" if trajectory else ""
    return f"{scheme}://{auth}{host}:{port}"


def tag_path(trajectory: str, group: str | None = None, secret: str | None = None) -> str:
    """The prefix of a tagged reverse-mode base URL: ``/t/T/k/SECRET`` or ``/t/T/g/G``."""
    path = "/t/" + encode_id(trajectory)
    if secret:
        return path + "/k/" + secret
    return path + ("/g/" + encode_id(group) if group else "")


def tag_headers(trajectory: str | None = None, group: str | None = None, channel: str | None = None) -> dict:
    names = (("X-Stepmill-Trajectory", trajectory), ("X-Stepmill-Group", group), ("X-Stepmill-Channel", channel))
    return {name: encode_id(value) for name, value in names if value}


# -- parsing ------------------------------------------------------------------------------------
def split_tag_path(path: str) -> tuple[Tags, str] | None:
    """``/t/T/g/G/v1/x`` -> (Tags(T, G), ``/v1/x``); ``/t/T/k/S/...`` carries a secret; None when the
    path carries no tags (or tags that do not decode: the path is then left as it is)."""
    found = TAG_PATH.match(path)
    if not found:
        return None
    trajectory = _decoded_or_none(found.group(1))
    if trajectory is None:
        return None
    kind, value, rest = found.group(2), found.group(3), found.group(4) or "/"
    if kind == "k":
        return Tags(trajectory, secret=value), rest
    group = _decoded_or_none(value)
    if value and group is None:
        return None
    return Tags(trajectory, group, secret=value), rest


def from_proxy_authorization(value: str | None) -> Tags | None:
    """Tags from ``Proxy-Authorization: Basic base64(trajectory:group-or-secret)``."""
    if not value or not value.lower().startswith("basic "):
        return None
    try:
        user, _, password = base64.b64decode(value[6:].strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    trajectory = _decoded_or_none(user)
    if trajectory is None:
        return None
    return Tags(trajectory, _decoded_or_none(password), secret=password or None)


def header_index(headers) -> dict[str, str]:
    """mitmproxy's request headers by lower-cased name, in one pass (each ``headers.get`` is a scan of
    all of them); repeated headers are folded with ", " as ``headers.get`` does. Bytes that are not UTF-8
    stay surrogate-escaped (a tag of them decodes to nothing; ``stored_text`` before a step keeps one)."""
    index: dict[str, str] = {}
    for name, value in headers.fields:
        key = name.decode("latin-1").lower()
        text = value.decode("utf-8", "surrogateescape")
        index[key] = f"{index[key]}, {text}" if key in index else text
    return index


def stored_text(value: str) -> str:
    """``value`` as a step can store it: surrogate escapes (bytes of a header or path that are not UTF-8) as
    U+FFFD. ASCII (the usual case) is returned as it is, unscanned."""
    return value if value.isascii() else value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def pop_header_tags(headers, index: dict[str, str]) -> Tags | None:
    """Tags from the X-Stepmill-* headers, which are removed before the request goes upstream."""
    names = (TRAJECTORY_HEADER, GROUP_HEADER, CHANNEL_HEADER)
    if not any(name in index for name in names):
        return None
    values = [_decoded_or_none(index.get(name)) for name in names]
    for name in names:
        headers.pop(name, None)
    return Tags(*values) if any(values) else None


def session_id(index: dict[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        if index.get(name):
            return stored_text(index[name])
    return None
