"""The ids and timestamps the store stamps its rows with."""

from __future__ import annotations

import datetime as _dt
import uuid


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"
