"""The data pool: step records in SQLite (WAL), browsed and curated with Datasette."""

from stepmill.store.db import Store
from stepmill.store.records import StepRecord

__all__ = ["Store", "StepRecord"]
