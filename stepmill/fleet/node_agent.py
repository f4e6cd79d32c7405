"""A node of the fleet speaking for its file: heartbeats, and the readiness of its runs, to the coordinator.

``stepmill serve --node-id NAME`` runs one ``NodeAgent`` thread beside the HTTP server. Every
``interval_s`` it heartbeats and publishes what the node's SQLite file says of its runs:

- a run the rollout runner registered with this node's proxy (``run_credentials``) is published once it
  is complete: its group (with the size the runner registered here: every run of a rollout is registered
  before any starts), the run on this node, and finished + committed (the proxy completes a run only
  once every call of it is committed to the file) + scored (it has a reward) with its policy version;
- a run someone else registered with the coordinator on this node (a runner that spreads a group over
  nodes registers the group's full size itself) is reported from the file the same way.

A run that is not complete is not reported: its group waits. Every call is idempotent, so a node that
restarts publishes again harmlessly; what the coordinator refuses (a run id another node holds) is
kept in ``problems`` and logged, never merged.
"""

from __future__ import annotations

import logging
import threading

from stepmill.errors import Conflict, NotFound, StoreUnavailable
from stepmill.store import Store

log = logging.getLogger("stepmill.fleet")


class NodeAgent(threading.Thread):
    """Heartbeats and publishes the node's runs (a daemon thread; ``publish_once`` for one pass)."""

    def __init__(self, db_path: str, coordinator, node_id: str, serve_url: str, *, interval_s: float = 2.0):
        super().__init__(name=f"stepmill-node-{node_id}", daemon=True)
        self.db_path, self.fleet, self.node_id, self.serve_url = db_path, coordinator, node_id, serve_url
        self.interval_s = interval_s
        self.published: set[str] = set()  # runs reported finished, committed and scored
        self.problems: dict[str, str] = {}  # run id -> what the coordinator refused
        self._stop = threading.Event()
        self._store: Store | None = None
        coordinator.register_node(node_id, serve_url)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish_once()
            except StoreUnavailable as exc:  # the coordinator is away: the next pass tries again
                log.warning("stepmill: node %s: %s", self.node_id, exc)
            except Exception:
                log.exception("stepmill: node %s: publishing failed", self.node_id)
            self._stop.wait(self.interval_s)

    def publish_once(self) -> int:
        """One heartbeat and one pass over the file; returns how many runs were reported."""
        try:
            self.fleet.heartbeat(self.node_id)
        except NotFound:  # the coordinator's database was replaced: register again
            self.fleet.register_node(self.node_id, self.serve_url)
        if self._store is None:
            self._store = Store(self.db_path, readonly=True)
        runs = {row["trajectory_id"]: row for row in self._store.run_readiness()}
        reported = 0
        for run_id, row in runs.items():
            if run_id in self.published or run_id in self.problems or not row["complete"]:
                continue
            try:
                self._register(row)
                reported += self._report(row)
            except (Conflict, NotFound) as exc:
                self.problems[run_id] = str(exc)
                log.warning("stepmill: node %s: run %s not published: %s", self.node_id, run_id, exc)
        for run_id in self.fleet.runs_to_report(self.node_id):
            row = runs.get(run_id) or self._unregistered(run_id)
            if row is not None and row["complete"] and run_id not in self.published:
                reported += self._report(row)
        return reported

    def _register(self, row: dict) -> None:
        try:
            self.fleet.register_group(row["group_id"], row["group_size"], channel=row["channel"] or "train")
        except Conflict:
            pass  # registered with another size by a runner that spreads the group over nodes: its size holds
        self.fleet.register_run(row["trajectory_id"], group_id=row["group_id"], node_id=self.node_id,
                                policy_version=row["policy_version"])

    def _report(self, row: dict) -> int:
        self.fleet.report(row["trajectory_id"], finished=True, committed=True, scored=row["scored"],
                          policy_version=row["policy_version"])
        if row["scored"]:
            self.published.add(row["trajectory_id"])
        return 1

    def _unregistered(self, run_id: str) -> dict | None:
        """A run the coordinator places here that no runner registered with this proxy: the file's word."""
        trajectory = self._store.trajectory(run_id)
        if trajectory is None:
            return None
        return {"trajectory_id": run_id, "complete": trajectory["status"] == "complete",
                "scored": trajectory["reward"] is not None, "policy_version": trajectory["policy_version"]}
