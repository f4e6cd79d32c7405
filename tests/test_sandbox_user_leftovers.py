"""User mode: what a run leaves in the folders every user may write (/tmp, /var/tmp, /dev/shm) — a
file, a folder of files, a link — is gone when the run ends, so it never meets the next run of its
uid; the run's own folder and log (under /var/tmp here) stay."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from .conftest import STEPMILL
from .rollout_files import write_rollout

LEAVES = """
import os, sys
marker = sys.argv[1]
for top in ("/tmp", "/var/tmp", "/dev/shm"):
    open(f"{top}/left-{marker}", "w").write("for the next run of this uid")
    os.makedirs(f"{top}/left-{marker}.d/deeper")
    open(f"{top}/left-{marker}.d/deeper/note", "w").write("for the next run of this uid")
    os.symlink("/etc/passwd", f"{top}/left-{marker}.link")
print("left", marker)
"""


def test_a_user_mode_run_leaves_nothing_in_the_shared_temporary_folders(proxy):
    if os.geteuid() != 0:
        pytest.skip("isolation = user needs the runner to be root")
    marker = uuid.uuid4().hex[:10]
    base = Path(tempfile.mkdtemp(prefix="stepmill-leftovers-", dir="/var/tmp"))
    base.chmod(0o755)  # runs of other uids reach their folders in it
    left = [Path(top, f"left-{marker}{suffix}") for top in ("/tmp", "/var/tmp", "/dev/shm")
            for suffix in ("", ".d", ".link")]
    try:
        config = write_rollout(base, proxy, dataset=f"leftovers-{marker}", command=["/usr/bin/python3", "-c", LEAVES,
                                                                                       marker],
                               tasks=[{"id": "t1", "prompt": "x"}], isolation='mode = "user"',
                               run=f'runs_dir = "{base / "runs"}"')
        done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                              timeout=120)
        assert "1 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr[-3000:]
        [row] = proxy.store().query("SELECT metadata FROM trajectories WHERE id LIKE ?", [f"leftovers-{marker}-%"])
        log = Path(json.loads(row["metadata"])["log"])
        assert log.read_text().strip() == f"left {marker}", "the run did not run, or its log went with its files"
        kept = [str(path) for path in left if os.path.lexists(path)]
        assert not kept, f"a user mode run's files outlived it, for the next run of its uid: {kept}"
        assert Path("/etc/passwd").exists()  # a link was removed, never what it names
    finally:
        for path in left:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                path.unlink()
        shutil.rmtree(base, ignore_errors=True)


def test_a_run_that_never_starts_still_ends_as_its_mode_says(proxy):
    """A user mode run whose folder cannot be filled (its runs' disk is full: its CA bundle does not fit)
    never starts; its mode's end still runs, so what a killed earlier run of its uid left in /tmp goes."""
    if os.geteuid() != 0:
        pytest.skip("isolation = user needs the runner to be root")
    marker = uuid.uuid4().hex[:10]
    first_uid = 62000 + int(marker[:4], 16) % 2000  # a uid no other test leases meanwhile
    base = Path(tempfile.mkdtemp(prefix="stepmill-never-started-", dir="/var/tmp"))
    base.chmod(0o755)
    full = base / "full"
    full.mkdir()
    left = Path("/tmp", f"left-by-a-killed-run-{marker}")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(full)],
                             capture_output=True, text=True, check=False)
    try:
        if mounted.returncode != 0:
            pytest.skip(f"a small tmpfs cannot be mounted here: {mounted.stderr.strip()}")
        with open(full / "filler", "wb", buffering=0) as filler:  # the disk full, as a runaway log leaves it
            with pytest.raises(OSError):
                while True:
                    filler.write(b"\0" * 4096)
        left.write_text("for the next run of this uid")
        os.chown(left, first_uid, first_uid)
        config = write_rollout(base, proxy, dataset=f"never-{marker}", command=["/usr/bin/python3", "-c", "pass"],
                               tasks=[{"id": "t1", "prompt": "x"}],
                               isolation=f'mode = "user"\nfirst_uid = {first_uid}', run=f'runs_dir = "{full / "runs"}"')
        done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                              timeout=120)
        assert "No space left on device" in done.stderr, done.stderr[-3000:]
        assert not left.exists(), "a run that never started was not ended: its uid's leftovers stayed"
    finally:
        left.unlink(missing_ok=True)
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(full)], check=False)
        shutil.rmtree(base, ignore_errors=True)
