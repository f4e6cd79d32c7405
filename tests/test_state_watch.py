"""The proxy learns of the runs other processes register, off its loop; a look that fails is looked again."""

from __future__ import annotations

from stepmill.auth.secret_hashes import secret_hash
from stepmill.pipeline.state_watch import StateWatch
from stepmill.store import Store

from .conftest import wait_until


def test_changes_by_another_process_are_reported(tmp_path):
    db = tmp_path / "w.db"
    other = Store(db)
    other.start_trajectory(trajectory_id="before", group_id="g")
    other.register_run("before", secret_hash("s1"))
    runs = []
    watch = StateWatch(str(db), on_run=runs.append, refresh=0.05)
    try:
        assert [run.trajectory_id for run in runs] == ["before"]  # read at once
        other.start_trajectory(trajectory_id="after", group_id="g")
        other.register_run("after", secret_hash("s2"))
        wait_until(lambda: len(runs) == 2, timeout=10, what="the watch to see the changes")
        assert runs[1].trajectory_id == "after" and runs[1].admits("s2") and runs[1].rowid > runs[0].rowid
        assert watch.status() == {"alive": True, "error": None, "unreadable_runs": 0}
    finally:
        watch.stop()
        other.close()


def test_a_failed_read_is_not_marked_seen_and_a_bad_registration_is_passed_over(tmp_path):
    """A look that fails (a busy file) is looked at again, and the watch lives on; a registration the
    proxy cannot take is counted, and the ones after it are still told."""
    db = tmp_path / "f.db"
    other = Store(db)
    runs = []

    def on_run(run):
        if run.trajectory_id == "bad":
            raise ValueError("a registration the proxy cannot take")
        runs.append(run.trajectory_id)

    watch = StateWatch(str(db), on_run=on_run, refresh=0.05)
    reads = watch.store.registered_runs
    failing = [True]

    def flaky(after_rowid=0):
        if failing[0]:
            raise OSError("database is locked")
        return reads(after_rowid)

    watch.store.registered_runs = flaky
    try:
        for tid in ("bad", "good"):
            other.start_trajectory(trajectory_id=tid, group_id="g")
            other.register_run(tid, secret_hash("s"))
        wait_until(lambda: watch.status()["error"] is not None, timeout=10, what="the watch to fail a look")
        assert runs == [] and watch.status()["alive"]
        failing[0] = False  # the file answers again: what changed while it did not is read now
        wait_until(lambda: runs == ["good"], timeout=10, what="the watch to read again")
        status = watch.status()
        assert status == {"alive": True, "error": None, "unreadable_runs": 1}, status
    finally:
        watch.stop()
        other.close()
