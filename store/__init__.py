"""The data pool: step records in SQLite (WAL), browsed and curated with Datasette."""

# This folder is the package stepmill.store. Imported under another name (``import store`` from the
# repository root) its modules would load twice, with two Store classes that are not the same.
if __name__ != "stepmill.store":
    raise ImportError(f"import stepmill.store, not {__name__}: this folder is installed as stepmill.store")

from stepmill.store.db import Store  # noqa: E402
from stepmill.store.records import StepRecord  # noqa: E402

__all__ = ["Store", "StepRecord"]
