"""``isolation = user``: each run as another OS user (a uid from ``first_uid`` on, leased to it alone on
the machine by ``uids.py``; the runner must be root). No namespace of its own: it sees the host's files, processes and
network as any user does, so what protects the runner's data is file modes. Files stepmill creates
are owner-only; a dataset file other users can read is refused (``check_dataset``). It runs with
``no_new_privs`` (no setuid binary gives it more) and a new session keyring. What a run of a uid
leaves behind — processes, keys in that uid's keyrings, files it owns in the shared temporary
folders (``SHARED_TEMP``) — is gone before the next run of that uid starts, and when it ends."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

from stepmill.children import die_with_parent, prctl
from stepmill.runner.isolation.policy import Policy, RunPlace, Start, give_to, own_home
# The sandbox's first step (standard library only, started by path) holds the one copy of these.
from stepmill.runner.isolation.sandbox_inside import KEYCTL_JOIN_SESSION_KEYRING, SYS_KEYCTL
from stepmill.runner.isolation.sandbox_inside import become as become_user

# Folders every user may write and no run's end removes by itself: what a run of a uid leaves there
# would meet the next run of that uid.
SHARED_TEMP = ("/tmp", "/var/tmp", "/dev/shm")


def check_dataset(dataset: str) -> str | None:
    """In user mode a run reads whatever other users may: a dataset readable by them gives answers away."""
    mode = os.stat(dataset).st_mode
    if mode & (stat.S_IROTH | stat.S_IRGRP):
        return (f"isolation = user: the dataset {dataset} is readable by other users, agents included (its "
                f"answers too): chmod go-r it, or copy it to a private file")
    return None


def unreachable(runs_root) -> str | None:
    """Runs of other uids must reach their own folder in the runs' root: every folder above it open to others."""
    for folder in Path(runs_root).resolve().parents:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return (f"isolation = user: the runs' folder {runs_root} is inside {folder}, which other users "
                    f"(the runs) cannot enter: set [run] runs_dir (or --runs-dir) to a folder they can")
    return None


PR_SET_NO_NEW_PRIVS = 38
KEYCTL_CLEAR = 7
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5
# Looked up here, in the parent: a ``preexec_fn`` must not load a library (see stepmill.children).
_syscall = ctypes.CDLL(None, use_errno=True).syscall


def become(uid: int):
    """A ``preexec_fn`` part: the run's own uid and gid (the same number), no supplementary groups."""
    return lambda: become_user(uid, uid)


def confine() -> None:
    """After ``become``, in the run's first process: no setuid binary raises it again, and a session
    keyring of its own (none of the runner's keys in reach)."""
    if prctl is None or prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        os._exit(126)  # a run that could become root again never starts
    _syscall(SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, None)


def clear_keys() -> None:
    """As the run's uid: its user keyrings emptied (they outlive its processes; the next run of the uid
    would read what it left there)."""
    for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
        _syscall(SYS_KEYCTL, KEYCTL_CLEAR, ctypes.c_long(ring))


def end_all(uid: int, runs_root: Path) -> None:
    """Kill every process of ``uid``, empty its keyrings and remove its files in the shared temporary
    folders: what a run left behind (a daemon in its own session, a key, a file in /tmp) would otherwise
    meet the next run of the same uid. A child that becomes ``uid`` signals all it may (kill(-1) spares
    the caller), clears the keyrings, then exits."""
    def kill_as_uid():
        become(uid)()
        os.kill(-1, signal.SIGKILL)
        clear_keys()

    subprocess.run(["/bin/true"], preexec_fn=kill_as_uid, check=False)
    remove_files_of(uid, runs_root)


def remove_files_of(uid: int, runs_root: Path) -> None:
    """What ``uid`` owns in the shared temporary folders (a file, a link, a folder with all in it), once
    its processes are gone (none makes more meanwhile). Only their own entries: a uid makes nothing
    deeper but in a folder someone opened to all, whose owner chose to share it. Never the runs' root
    (its run folders and logs are kept), never through a link (rmtree works by descriptor)."""
    keep = runs_root.resolve()
    for top in SHARED_TEMP:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)  # a file, or a link (never what it names)
                elif Path(entry.path).resolve() != keep:
                    shutil.rmtree(entry.path, ignore_errors=True)


class User(Policy):
    name = "user"

    def sees(self, place: RunPlace) -> dict[str, str]:
        end_all(place.uid, place.run_dir.parent)  # what a run of this uid left (a killed runner's) goes first
        home = own_home(place)
        give_to(place.run_dir, place.uid)
        os.chmod(place.run_dir, 0o700)
        return home

    def start(self, place: RunPlace, command: list[str], env: dict, nproc: int) -> Start:
        switch = become(place.uid)
        return Start(command, lambda: (switch(), confine(), die_with_parent()))  # a uid change clears the parent signal

    def end(self, place: RunPlace) -> None:
        end_all(place.uid, place.run_dir.parent)  # nothing of this run meets the next run of its uid


POLICY = User
