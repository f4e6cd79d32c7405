"""How a command opens the store: readers read-only, writers only onto a database that exists
(a mistyped --db must not leave an empty database behind)."""

from __future__ import annotations

import os

from stepmill.errors import StoreUnavailable


def open_reader(db: str):
    """The store, read-only: readers never wait for the write lock or change the file."""
    from stepmill.store import Store

    return Store(db, readonly=True)


def open_writer(db: str):
    """The store, for writing, when ``db`` is already a file."""
    from stepmill.store import Store

    if not os.path.exists(db):
        raise StoreUnavailable(f"no stepmill database at {db}")
    return Store(db)
