"""Everything stepmill writes is its owner's only: the database with its -wal and -shm, the journal,
exports and batches (files 0600, folders it makes 0700), whatever the umask says."""

import os
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stepmill.store import StepRecord, Store
from stepmill.pipeline.journal import Journal, encode_entry

from .conftest import STEPMILL


@pytest.fixture
def open_umask():
    """The usual umask (022): what a plain mitmdump or a shell gives, files readable by everyone."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): _mode(p) for p in sorted(root.rglob("*"))}


def _assert_owner_only(root: Path) -> None:
    found = _modes(root)
    loose = {name: oct(mode) for name, mode in found.items()
             if mode != (0o700 if (root / name).is_dir() else 0o600)}
    assert not loose, loose


def _step(store: Store) -> str:
    run = store.start_trajectory(trajectory_id="private-run", metadata={"answer": "42"})
    step = store.record_step(StepRecord(
        api="openai.chat", model="m", trajectory_id=run["id"], messages=[{"role": "user", "content": "6*7?"}],
        completion={"role": "assistant", "content": "42"}, prompt_ids=[1, 2, 3], response_ids=[4, 5],
        logprobs=[-0.1, -0.2], token_provenance="exact"))
    store.add_reward(run["id"], 1.0, source="env")
    return step


def test_the_database_its_wal_and_shm_and_the_journal_are_owner_only(tmp_path, open_umask):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    store = Store(str(data / "steps.db"))
    _step(store)
    journal = Journal.create(data / "steps.db")
    journal.append(encode_entry({"kind": "step"}, [b"a secret answer"]))
    assert {"steps.db", "steps.db-wal", "steps.db-shm", "steps.db.journal"} <= set(os.listdir(data))
    assert journal.segments() and (journal.folder / "lock").exists()
    assert _mode(data) == 0o755  # the user's own folder is left as it is
    _assert_owner_only(data)  # checked while the connection is open: -wal and -shm exist now
    journal.release()
    store.close()


def test_a_database_an_older_stepmill_left_open_to_others_is_closed_when_opened_to_write(tmp_path, open_umask):
    path = tmp_path / "old.db"
    Store(str(path)).close()
    os.chmod(path, 0o644)
    (tmp_path / "old.db.journal").mkdir(mode=0o755)
    store = Store(str(path))
    _step(store)
    journal = Journal.create(path)
    journal.append(encode_entry({"kind": "step"}, []))
    _assert_owner_only(tmp_path)
    journal.release()
    store.close()


def test_exports_and_batches_are_owner_only(tmp_path, open_umask):
    db = tmp_path / "steps.db"
    store = Store(str(db))
    _step(store)
    store.close()
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    commands = [["export", "--format", "parquet", "--out", str(out / "new" / "parquet")],
                ["export", "--format", "parquet", "--flavour", "messages", "--out", str(out / "messages")],
                ["export", "--format", "jsonl", "--out", str(out / "steps.jsonl")],
                ["batches", "--layout", "step", "--out", str(out / "batches" / "step")],
                ["batches", "--layout", "trajectory", "--out", str(out / "batches" / "trajectory")]]
    for command in commands:
        done = subprocess.run(STEPMILL + command + ["--db", str(db)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    written = _modes(out)
    assert {"new/parquet/part-00000.parquet", "new/parquet/manifest.json", "messages/part-00000.parquet",
            "steps.jsonl", "batches/step/batch-00000.npz", "batches/step/batch-00000.json",
            "batches/trajectory/batch-00000.npz"} <= set(written)
    _assert_owner_only(out)
    assert np.load(out / "batches" / "step" / "batch-00000.npz")["input_ids"].shape[0] == 1  # still a real .npz
    # an export folder the user made is theirs: its mode is left alone
    (out / "mine").mkdir(mode=0o755)
    from stepmill.trainer_bridge.parquet import export_parquet

    export_parquet(Store(str(db), readonly=True), out / "mine")
    assert _mode(out / "mine") == 0o755 and _mode(out / "mine" / "manifest.json") == 0o600
