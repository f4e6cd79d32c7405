"""Training runs' numbers per policy version (the ``train_metrics`` table): what ``stepmill train``
measured — reward, held-out reward, the engine-vs-trainer logprob gap, staleness, diversity — for a
run and its paired control, read by ``stepmill train``'s summary and the dashboard's chart."""

from __future__ import annotations

import math

from stepmill.errors import BadInput
from stepmill.store.connection import Transactions
from stepmill.store.ids import now_iso


class Training:
    """Record and read training runs' numbers."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def record_train_metrics(self, run: str, version: int, metrics: dict[str, float | int | None]) -> None:
        """Set ``run``'s numbers for ``version`` (a name measured again replaces its value)."""
        if not run:
            raise BadInput("a training run needs a name")
        rows = []
        for name, value in metrics.items():
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise BadInput(f"{name}: a training metric is a finite number or None, not {value!r}")
            rows.append([run, int(version), name, None if value is None else float(value), now_iso()])
        with self.tx.write() as conn:
            conn.executemany("INSERT OR REPLACE INTO train_metrics (run, version, name, value, recorded_at) "
                             "VALUES (?, ?, ?, ?, ?)", rows)

    def train_metrics(self, run: str | None = None) -> list[dict]:
        """One row per run and version, oldest first: ``{"run", "version", <name>: value, …}``."""
        params: list = []
        where = ""
        if run is not None:
            where, params = "WHERE run = ?", [run]
        table: dict[tuple, dict] = {}
        for row in self.tx.query(f"SELECT run, version, name, value FROM train_metrics {where} ORDER BY run, version",
                                 params):
            table.setdefault((row["run"], row["version"]), {"run": row["run"], "version": row["version"]})[
                row["name"]] = row["value"]
        return list(table.values())

    def train_runs(self) -> list[str]:
        """The names of the training runs with numbers recorded."""
        return [row["run"] for row in self.tx.query("SELECT DISTINCT run FROM train_metrics ORDER BY run")]
