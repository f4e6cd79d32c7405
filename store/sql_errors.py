"""What SQLite's errors mean to callers: the file cannot be used now (``StoreUnavailable``: locked,
busy, full, read-only, an I/O error), or a user's condition is not valid SQL (``BadInput``); and the
parameters the store binds after a user's condition."""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from stepmill.errors import BadInput, StoreUnavailable

# SQLite's primary result codes that say the file cannot be used now, not that a statement is wrong:
# BUSY, LOCKED, READONLY, IOERR, FULL, CANTOPEN.
_UNAVAILABLE = {5, 6, 8, 10, 13, 14}


def unavailable(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and code is not None and code & 0xFF in _UNAVAILABLE


@contextmanager
def file_errors() -> Iterator[None]:
    """SQLite's "the file cannot be used now" as ``StoreUnavailable``; other errors pass unchanged."""
    try:
        yield
    except sqlite3.Error as exc:
        if unavailable(exc):
            raise StoreUnavailable(str(exc)) from exc
        raise


@contextmanager
def user_condition(where: str | None) -> Iterator[None]:
    """Around a query that applies a user's ``--where``: SQLite's complaint about it as ``BadInput``
    (what the file itself refuses stays ``StoreUnavailable``)."""
    try:
        with file_errors():
            yield
    except sqlite3.Error as exc:
        if not where:
            raise
        raise BadInput(f"--where {where!r}: {exc}") from None


def user_rows(where: str | None, query: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """The rows of ``query()``, a query that applies a user's condition, read one at a time (SQLite may
    refuse the condition on any row, not only the first) under ``user_condition``."""
    end = object()
    with user_condition(where):
        rows = iter(query())
    while True:
        with user_condition(where):
            row = next(rows, end)
        if row is end:
            return
        yield row


class UserParameters:
    """A user's parameters (positional or named) with the store's own bound after them in the same
    style, so the user's ``?`` keep their places."""

    def __init__(self, params: Any):
        self.named = isinstance(params, dict)
        self.values = dict(params) if self.named else list(params)

    def bind(self, name: str, value: Any) -> str:
        """The placeholder for ``value`` (named ``name`` where the user's are named)."""
        if self.named:
            self.values[name] = value
            return f":{name}"
        self.values.append(value)
        return "?"
