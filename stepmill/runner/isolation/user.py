"""``isolation = user``: each concurrent run as another OS user (uids ``first_uid``, ``first_uid + 1``,
…; the runner must be root). No namespace of its own: it sees the host's files, processes and
network as any user does, so what protects the runner's data is file modes. Files stepmill creates
are owner-only; a dataset file other users can read is refused (``check_dataset``). What a run of a
uid leaves behind is killed before the next run of that uid starts, and when it ends."""

from __future__ import annotations

import os
import signal
import stat
import subprocess

from stepmill.children import die_with_parent
from stepmill.runner.isolation.policy import Policy, RunPlace, Start, give_to, own_home


def check_dataset(dataset: str) -> str | None:
    """In user mode a run reads whatever other users may: a dataset readable by them gives answers away."""
    mode = os.stat(dataset).st_mode
    if mode & (stat.S_IROTH | stat.S_IRGRP):
        return (f"isolation = user: the dataset {dataset} is readable by other users, agents included (its "
                f"answers too): chmod go-r it, or copy it to a private file")
    return None


def unreachable(runs_root) -> str | None:
    """Runs of other uids must reach their own folder in the runs' root: every folder above it open to others."""
    from pathlib import Path

    for folder in Path(runs_root).resolve().parents:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return (f"isolation = user: the runs' folder {runs_root} is inside {folder}, which other users "
                    f"(the runs) cannot enter: set [run] runs_dir (or --runs-dir) to a folder they can")
    return None


def become(uid: int):
    """A ``preexec_fn`` part: the run's own uid and gid, no supplementary groups."""
    def switch():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return switch


def end_all(uid: int) -> None:
    """Kill every process of ``uid``: what a run left behind (a daemon in its own session) would
    otherwise meet the next run of the same uid. A child that becomes ``uid`` signals all it may
    (kill(-1) spares the caller), then exits."""
    def kill_as_uid():
        become(uid)()
        os.kill(-1, signal.SIGKILL)

    subprocess.run(["/bin/true"], preexec_fn=kill_as_uid, check=False)


class User(Policy):
    name = "user"

    def sees(self, place: RunPlace) -> dict[str, str]:
        end_all(place.uid)  # whatever a run of this uid left behind (a killed runner's) goes first
        home = own_home(place)
        give_to(place.run_dir, place.uid)
        os.chmod(place.run_dir, 0o700)
        return home

    def start(self, place: RunPlace, command: list[str], env: dict, nproc: int) -> Start:
        switch = become(place.uid)
        return Start(command, lambda: (switch(), die_with_parent()))  # a uid change clears the parent signal

    def end(self, place: RunPlace) -> None:
        end_all(place.uid)  # nothing of this run lives on to meet the next run of its uid


POLICY = User
