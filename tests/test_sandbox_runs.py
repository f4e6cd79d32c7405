"""Run folders with a home and an end: a rollout's run folders live beside its database (or where
``[run] runs_dir`` / ``--runs-dir`` says), each run's log is kept and linked from its trajectory, and
folders older than ``[run] keep_runs_days`` are removed when a rollout starts."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

from stepmill.runner.run_folders import ROOT_MARK, RUN_MARK

from .conftest import STEPMILL
from .rollout_files import write_rollout

SAID = "hello from the run"


def _rollout(folder: Path, proxy, *, run_extra: str = "", args: tuple = ()) -> tuple[subprocess.CompletedProcess, dict]:
    marker = uuid.uuid4().hex[:10]
    config = write_rollout(folder, proxy, dataset=f"runs-{marker}", command=["/usr/bin/python3", "-c", f"print({SAID!r})"],
                           tasks=[{"id": "t1", "prompt": "say hello", "answer": "0"}], run=run_extra)
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress", *args], capture_output=True, text=True,
                          timeout=300)
    assert "1 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr[-3000:]
    [row] = proxy.store().query("SELECT metadata FROM trajectories WHERE id LIKE ?", [f"runs-{marker}-%"])
    return done, json.loads(row["metadata"])


def test_a_runs_folder_is_beside_its_database_and_its_log_is_linked(proxy, tmp_path):
    done, metadata = _rollout(tmp_path, proxy)
    runs_root = Path(f"{Path(proxy.db).resolve()}.runs")
    log = Path(metadata["log"])
    assert runs_root in log.parents, f"the run's folder is not beside the database: {metadata}"
    assert log.read_text().strip() == SAID
    assert log.parent == Path(metadata["workdir"])


def test_runs_dir_from_the_command_line(proxy, tmp_path):
    chosen = tmp_path / "chosen-runs"
    done, metadata = _rollout(tmp_path, proxy, args=("--runs-dir", str(chosen)))
    assert chosen.resolve() in Path(metadata["log"]).parents, metadata
    assert oct(chosen.stat().st_mode & 0o777) == "0o711"  # runs of other uids reach their folder, list none


def _aged(folder: Path, days: float) -> None:
    """``folder`` and what is in it last changed ``days`` ago."""
    then = time.time() - days * 86400
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (then, then), follow_symlinks=False)


def test_old_run_folders_are_removed_when_a_rollout_starts(proxy, tmp_path):
    """Only stepmill's own run folders go: one it made long ago (its mark, or its name), never a folder
    someone else put in its runs folder, however old."""
    runs_root = tmp_path / "runs"
    first, _ = _rollout(tmp_path, proxy, run_extra=f'runs_dir = "{runs_root}"\nkeep_runs_days = 7')
    assert (runs_root / ROOT_MARK).is_file(), "a runs folder stepmill made carries no mark"
    [made] = [folder for folder in runs_root.iterdir() if folder.is_dir()]
    assert (made / RUN_MARK).is_file(), "a run folder stepmill made carries no mark"
    unmarked = runs_root / "t1-abcd1234"  # named as stepmill names run folders (its run removed the mark)
    foreign = runs_root / "someone-elses"
    for folder in (unmarked, foreign):
        (folder / "work").mkdir(parents=True)
        (folder / "work" / "agent.log").write_text("an earlier run's output\n")
    for folder in (made, unmarked, foreign):
        _aged(folder, 10)
    done, metadata = _rollout(tmp_path, proxy, run_extra=f'runs_dir = "{runs_root}"\nkeep_runs_days = 7')
    assert not made.exists(), "a run folder older than keep_runs_days was kept"
    assert not unmarked.exists(), "a run folder named as stepmill names them, older than keep_runs_days, was kept"
    assert foreign.exists(), "a folder stepmill did not make was removed"
    assert Path(metadata["log"]).exists()


def test_a_folder_of_someone_elses_is_never_a_runs_folder(proxy, tmp_path):
    """``--runs-dir`` naming a folder that holds other data (``/tmp``, a home) is refused before anything
    runs, naming the key: its old folders are not removed and its mode is not changed."""
    data = tmp_path / "data"
    (data / "photos").mkdir(parents=True)
    (data / "photos" / "2019.jpg").write_bytes(b"someone's data")
    _aged(data / "photos", 400)
    data.chmod(0o755)
    config = write_rollout(tmp_path, proxy, dataset=f"runs-{uuid.uuid4().hex[:10]}", command=["/usr/bin/python3", "-c", "pass"],
                           tasks=[{"id": "t1", "prompt": "x"}], run="keep_runs_days = 7")
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress", "--runs-dir", str(data)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "[run] runs_dir (--runs-dir)" in done.stderr, done.stderr[-2000:]
    assert (data / "photos" / "2019.jpg").read_bytes() == b"someone's data", "a folder stepmill did not make was pruned"
    assert oct(data.stat().st_mode & 0o777) == "0o755", "a folder stepmill did not make was chmodded"
    assert not (data / ROOT_MARK).exists()


def test_user_mode_says_when_its_runs_cannot_reach_their_folders(proxy, tmp_path):
    """Runs of other uids must enter the runs' folder: one inside a folder only its owner may enter is
    refused before anything runs, and the message says what to set."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("isolation = user needs the runner to be root")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    marker = uuid.uuid4().hex[:10]
    config = write_rollout(tmp_path, proxy, dataset=f"runs-{marker}", command=["/usr/bin/python3", "-c", "pass"],
                           tasks=[{"id": "t1", "prompt": "x"}], isolation='mode = "user"',
                           run=f'runs_dir = "{private / "runs"}"')
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "which other users (the runs) cannot enter: set [run] runs_dir" in done.stderr, (
        done.stderr[-2000:])
