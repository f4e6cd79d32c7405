"""A trainer killed mid-run (SIGKILL) continues with ``stepmill train --resume`` from its last
checkpoint, on the real vLLM: the run ends at its last version with the engine's weight version, the
proxy's stamp and the checkpoint agreeing, every version's numbers recorded, and every group of the
run trained on once: acknowledged exactly once in the consumption ledger, and counted once in the
versions' numbers (a group trained again after the resume would be counted twice)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from stepmill.demo.trainer_child import trainer_command
from stepmill.errors import StoreUnavailable
from stepmill.store import Store

from .conftest import wait_until
from .test_train_loop import acked_once, rollout_file, tied_engine  # noqa: F401  (tied_engine: the fixture)

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(2400)]
ITERATIONS = 3


def test_a_trainer_killed_mid_run_resumes_from_its_last_version(tied_engine, tmp_path):
    from stepmill.train.checkpoint import checkpoint_folder, latest
    from stepmill.train.engine_sync import VLLMSync

    path = rollout_file(tmp_path, tied_engine, agent="black-box", tasks=2, iterations=ITERATIONS, control=False)
    db = tmp_path / "stepmill.db"
    folder = checkpoint_folder(str(db), "train")
    command, env = trainer_command(str(path), "--db", str(db))
    log = open(tmp_path / "first.log", "wb")
    first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def second_step_claimed():
        if first.poll() is not None:
            raise AssertionError(f"the trainer ended before the kill: {(tmp_path / 'first.log').read_text()[-3000:]}")
        if not (folder / "v000001.pt").exists():
            return False
        try:
            rows = Store(str(db), readonly=True).consumption_staleness(channel="train")
        except StoreUnavailable:
            return False
        return any(r["status"] == "leased" for r in rows)

    wait_until(second_step_claimed, timeout=1200, interval=0.05, what="version 1's checkpoint and the next claim")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = latest(folder)["version"]
    assert 1 <= killed_at < ITERATIONS

    done = subprocess.run(command + ["--resume"], env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from version {killed_at}" in done.stderr
    store = Store(str(db), readonly=True)
    versions = {row["version"]: row for row in store.train_metrics("train")}
    assert sorted(versions) == list(range(ITERATIONS + 1))
    engine = VLLMSync(tied_engine.url, tied_engine.name)
    try:
        assert engine.weight_version() == store.policy_version() == str(ITERATIONS) == str(latest(folder)["version"])
    finally:
        engine.close()
    groups, once = acked_once(db, "train")
    assert groups == once > 0
    assert sum(int(row["groups"]) + int(row.get("empty_groups") or 0) for row in versions.values()) == groups
