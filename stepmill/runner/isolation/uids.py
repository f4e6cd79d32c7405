"""The host uids runs become (user mode, and a root runner's sandbox), each held by one run of the
machine at a time, whichever rollout, Ray node or process it belongs to.

A uid is a run's whole identity on the host: user mode ends a run by killing every process of its
uid, and two runs of one uid could signal and read each other. A counter per rollout is not enough
(two rollouts, or two Ray nodes on one machine, would both start at ``first_uid``), so a uid is
leased: an exclusive ``flock`` on a file named for it in a folder only root may write. The lease
lasts while its descriptor is open, so a runner killed with its runs lets go of them with it; a
run's processes never hold the descriptor (it is close-on-exec), and cannot open the files (0600).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from pathlib import Path

from stepmill.errors import ConfigError

SPAN = 4096  # uids tried from first_uid on before a lease is refused


def leases_folder() -> Path:
    """Where the leases live: the machine's run-time folder where the runner may write there (root),
    else the temporary one (a runner that is not root: its runs keep its uid, and the lease only
    counts them)."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    folder = base / f"stepmill-uids-{os.geteuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.geteuid() or folder.stat().st_mode & 0o077:
        raise ConfigError(f"{folder} must be a folder of uid {os.geteuid()} that no one else can write: "
                          "stepmill leases the uids of runs there")
    return folder


class UidLeases:
    """Lease and give back the uids of runs, from ``first_uid`` on, one run per uid on the machine."""

    def __init__(self, first_uid: int):
        self.first_uid = first_uid
        self.folder: Path | None = None  # made at the first lease: a rollout whose runs keep the runner's uid never does
        self.held: dict[int, int] = {}  # uid -> the descriptor holding its lease
        self.lock = threading.Lock()

    def take(self) -> int:
        """The lowest uid from ``first_uid`` on that no run of this machine holds, leased to the caller."""
        with self.lock:
            if self.folder is None:
                self.folder = leases_folder()
            for uid in range(self.first_uid, self.first_uid + SPAN):
                if uid in self.held:
                    continue
                fd = os.open(self.folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.held[uid] = fd
                return uid
        raise ConfigError(f"no uid from {self.first_uid} to {self.first_uid + SPAN - 1} is free for a run: "
                          f"other runs of this machine hold them all")

    def give(self, uid: int) -> None:
        """The run of ``uid`` has ended and nothing of it lives: another run may become it."""
        with self.lock:
            fd = self.held.pop(uid, None)
        if fd is not None:
            os.close(fd)  # the lease goes with the descriptor
