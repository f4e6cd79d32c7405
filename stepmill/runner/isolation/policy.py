"""The one interface every isolation mode has: what a run sees, how it is started, how it ends.

``agent_run._run_one`` calls these three, in order, for every run, whatever the mode; each mode is
one module of this package (``sandbox``, ``user``, ``container``, ``host``), so a reviewer reads one
file per mode and a new mode is one new file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class RunPlace:
    """One run as its isolation sees it (the runner's thread fills it in)."""

    run_dir: Path  # the run's folder: work/, home/, its CA bundle, its log
    trajectory: str
    uid: int  # the uid leased to it (uids.py): no other run of the machine has it meanwhile
    needs: list[Path] = field(default_factory=list)  # more it must see (a sandbox's tokenizer, modules)
    door: list[str] | None = None  # a sandboxed run's door: door_inside.py's arguments
    door_folder: Path | None = None  # where that door's sockets are

    @property
    def workdir(self) -> Path:
        return self.run_dir / "work"

    @property
    def home(self) -> Path:
        return self.run_dir / "home"


@dataclass
class Start:
    """How the run's first process is made: its command line, and what runs in the child before exec
    (after the runner put it in its control group)."""

    command: list[str]
    preexec: Callable[[], None] | None = None


class Policy:
    """A mode's rules for one rollout's runs. ``sees`` before the run's environment is final (it
    answers what the environment gains: a home of its own), ``start`` just before it starts,
    ``end`` once it has ended, however it ended: also when it never started, once its folder exists
    (``agent_run._run_one``)."""

    name = ""
    counts_own_processes = False  # the pids limit is set inside (sandbox), not by the runner's rlimits

    def __init__(self, isolation, private=None):
        self.isolation = isolation  # the [isolation] table (isolation.Isolation)
        self.private = private  # what no run may see (files.Private)

    def sees(self, place: RunPlace) -> dict[str, str]:
        return {}

    def start(self, place: RunPlace, command: list[str], env: dict, nproc: int) -> Start:
        raise NotImplementedError

    def end(self, place: RunPlace) -> None:
        pass


def own_home(place: RunPlace) -> dict[str, str]:
    """A home in the run's folder: agent CLIs write their state there, never in the runner's."""
    place.home.mkdir(exist_ok=True)
    return {"HOME": str(place.home)}


def give_to(path: Path, uid: int) -> None:
    """``path`` and everything in it to ``uid`` (its gid the same number); links are changed, not followed."""
    os.chown(path, uid, uid, follow_symlinks=False)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)

