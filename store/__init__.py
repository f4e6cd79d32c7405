"""The data pool: step records in SQLite (WAL), browsed and curated with Datasette."""

from .db import Store
from .records import StepRecord

__all__ = ["Store", "StepRecord"]
