"""The ids and timestamps the store stamps its rows with."""

from __future__ import annotations

import datetime as _dt
import uuid


def iso(moment: float | _dt.datetime) -> str:
    """A row's time, from epoch seconds or an aware datetime: ISO 8601 in UTC to the millisecond
    ("2025-01-02T03:04:05.678+00:00"), text that sorts as time does (the queries compare it so)."""
    if not isinstance(moment, _dt.datetime):
        moment = _dt.datetime.fromtimestamp(moment, _dt.UTC)
    return moment.astimezone(_dt.UTC).isoformat(timespec="milliseconds")


def now_iso() -> str:
    return iso(_dt.datetime.now(_dt.UTC))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"
