"""How values become column values: JSON text, compressed JSON, clean UTF-8, bounded integers.

Everything written to the file passes through here, so one odd value from an agent (a lone
surrogate, an integer past 2^63) cannot make a write fail.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from typing import Any

INT64 = 2**63
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Lone surrogates (undecodable header bytes, broken JSON escapes) become U+FFFD."""
    if text.isascii():  # most text, known from the string's header without a scan: no surrogate in it
        return text
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def clean(value: Any) -> Any:
    """A JSON-able value with every string cleaned and every key a string."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(str(k)): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return clean_text(str(value))


def dumps(value: Any) -> str | None:
    if value is None:
        return None
    return clean_text(json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str))


def loads(text: str | bytes | None) -> Any:
    if text is None:
        return None
    if isinstance(text, bytes):  # compressed columns (the wire form)
        text = zlib.decompress(text)
    return json.loads(text)


def packed(value: Any) -> bytes | None:
    """JSON, zlib-compressed, for the columns nobody queries with SQL."""
    return None if value is None else zlib.compress(dumps(value).encode(), 6)


def text_column(value: Any) -> str | None:
    """A value for a TEXT column: strings cleaned, anything else as its JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        return clean_text(value)
    return dumps(value)


def int_column(value: Any) -> int | None:
    """An integer SQLite can hold, or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not -INT64 <= value < INT64:
        return None
    return value


def float_column(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
