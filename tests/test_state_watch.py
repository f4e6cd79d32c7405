"""The proxy learns of policy versions and registered runs that other processes write, off its loop."""

from __future__ import annotations

from stepmill.auth.secret_hashes import secret_hash
from stepmill.pipeline.state_watch import StateWatch
from stepmill.store import Store

from .conftest import wait_until


def test_changes_by_another_process_are_reported(tmp_path):
    db = tmp_path / "w.db"
    other = Store(db)
    other.set_policy_version("p1")
    other.start_trajectory(trajectory_id="before", group_id="g")
    other.register_run("before", secret_hash("s1"))
    versions, runs = [], []
    watch = StateWatch(str(db), on_policy_version=versions.append, on_run=runs.append, refresh=0.05)
    try:
        assert versions == ["p1"] and [run.trajectory_id for run in runs] == ["before"]  # read at once
        other.set_policy_version("p2")
        other.start_trajectory(trajectory_id="after", group_id="g")
        other.register_run("after", secret_hash("s2"))
        wait_until(lambda: versions[-1] == "p2" and len(runs) == 2, timeout=10, what="the watch to see the changes")
        assert runs[1].trajectory_id == "after" and runs[1].admits("s2") and runs[1].rowid > runs[0].rowid
    finally:
        watch.stop()
        other.close()
