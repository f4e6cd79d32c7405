"""Limits per run: processes, memory, CPU time, file size; and its output log, capped.

A run is an RL policy running shell commands: a fork bomb, a memory hog or a flood of output must
end that run only. Where this machine lets the runner make control groups (cgroup v2, or v1's
``pids`` and ``memory`` controllers), a run gets one of its own: its number of processes and its
memory are limited whole, whatever it forks. Otherwise, and always for CPU time and file size,
rlimits limit each of its processes; its number of processes then by ``RLIMIT_NPROC``, which a
sandboxed run sets inside a user namespace of its own (``isolation/sandbox_inside.py``). Linux 5.14
and later count it per user *and user namespace* (ucounts), so the count is the run's alone, never
shared with other runs or the runner; older kernels count it per uid across namespaces, shared with
whatever else runs as that uid (the runner too, where it is not root). The run's record says which (``metadata.limits``) and what it ran into
(``metadata.limits_hit``).
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class Limits:
    pids: int = 1024  # processes (and threads) of the run at once
    memory_mb: int = 4096  # the run's memory (each process's address space, with rlimits)
    cpu_seconds: int = 0  # CPU time of each of its processes; 0: none (the run's timeout still holds)
    file_mb: int = 2048  # the largest file it may write
    log_kb: int = 1024  # of its output, the first and the last log_kb KiB are kept
    disk_mb: int = 0  # sandbox: its folder (work, home) is a tmpfs of this size; 0: its folder on the disk

    def __post_init__(self):
        for name in ("pids", "memory_mb", "cpu_seconds", "file_mb", "log_kb", "disk_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                from stepmill.errors import ConfigError

                raise ConfigError(f"[isolation.limits] {name} must be a whole number ≥ 0, not {value!r}")


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in ``controller``'s hierarchy (None: the v2 one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path
    return None


@dataclass
class RunGroup:
    """The run's own control group(s), or none: ``via`` says which ("cgroup v2", "cgroup v1" or "rlimits")."""

    limits: Limits
    via: str = "rlimits"
    folders: dict = field(default_factory=dict)  # controller ("v2", "pids", "memory") -> its folder
    counts_inside: bool = False  # the run sets RLIMIT_NPROC in its own user namespace (a sandbox)

    @classmethod
    def make(cls, name: str, limits: Limits, *, counts_inside: bool = False) -> "RunGroup":
        group = cls(limits, counts_inside=counts_inside)
        for attempt in (group._v2, group._v1):
            try:
                if attempt(name):
                    return group
            except OSError:
                pass
            group.remove()
            group.folders = {}
        group.via = "rlimits"
        return group

    def _v2(self, name: str) -> bool:
        own = _own_path(None)
        if own is None or not (CGROUP_ROOT / "cgroup.controllers").is_file():
            return False
        parent = CGROUP_ROOT / own.lstrip("/")
        if not {"pids", "memory"} <= set((parent / "cgroup.subtree_control").read_text().split()):
            return False
        folder = parent / name
        folder.mkdir()
        self.folders["v2"] = folder
        (folder / "pids.max").write_text(str(self.limits.pids or "max"))
        (folder / "memory.max").write_text(str(self.limits.memory_mb * 2**20) if self.limits.memory_mb else "max")
        if (folder / "memory.swap.max").exists():
            (folder / "memory.swap.max").write_text("0")
        self.via = "cgroup v2"
        return True

    def _v1(self, name: str) -> bool:
        for controller in ("pids", "memory"):
            own = _own_path(controller)
            base = CGROUP_ROOT / controller
            if own is None or not (base / "cgroup.procs").exists():
                return False
            folder = base / own.lstrip("/") / name
            folder.mkdir()
            self.folders[controller] = folder
        (self.folders["pids"] / "pids.max").write_text(str(self.limits.pids) if self.limits.pids else "max")
        if self.limits.memory_mb:
            (self.folders["memory"] / "memory.limit_in_bytes").write_text(str(self.limits.memory_mb * 2**20))
            swap = self.folders["memory"] / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(self.limits.memory_mb * 2**20))
        self.via = "cgroup v1"
        return True

    def enter(self) -> None:
        """In the run's first process, before it executes anything (a ``preexec_fn`` part): into its
        groups, then the rlimits."""
        pid = str(os.getpid()).encode()
        for folder in self.folders.values():  # plain system calls: between fork and exec, nothing that locks
            fd = os.open(os.path.join(folder, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        limits = self.limits
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.cpu_seconds:
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        if limits.file_mb:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 2**20,) * 2)
        if self.via == "rlimits":
            if limits.memory_mb:
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * 2**20,) * 2)
            if limits.pids and os.geteuid() != 0 and not self.counts_inside:  # per user; never for root
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.pids, limits.pids))

    def nproc_inside(self) -> int:
        """The processes the run may have at once, for it to set in its own user namespace (0: none to set)."""
        return self.limits.pids if self.counts_inside and self.via == "rlimits" else 0

    def record(self) -> dict:
        out = {"via": self.via, "pids": self.limits.pids, "memory_mb": self.limits.memory_mb,
               "cpu_seconds": self.limits.cpu_seconds, "file_mb": self.limits.file_mb, "log_kb": self.limits.log_kb,
               **({"disk_mb": self.limits.disk_mb} if self.limits.disk_mb else {})}
        if self.via == "rlimits":
            out["note"] = ("memory per process; processes: the run's own count, in its user namespace"
                           if self.counts_inside else "memory per process; processes per user (not for root)")
        return out

    def hit(self) -> list[str]:
        """The limits the run ran into (read before ``remove``)."""
        found = []
        try:
            if "v2" in self.folders:
                events = _pairs(self.folders["v2"] / "pids.events")
                found += ["pids"] if events.get("max", 0) else []
                memory = _pairs(self.folders["v2"] / "memory.events")
                found += ["memory"] if memory.get("oom_kill", 0) or memory.get("max", 0) else []
            if "pids" in self.folders:
                found += ["pids"] if _pairs(self.folders["pids"] / "pids.events").get("max", 0) else []
            if "memory" in self.folders:
                oom = _pairs(self.folders["memory"] / "memory.oom_control")
                failed = int((self.folders["memory"] / "memory.failcnt").read_text() or 0)
                found += ["memory"] if oom.get("oom_kill", 0) or failed else []
        except (OSError, ValueError):
            pass
        return found

    def remove(self) -> None:
        """Whatever of the run is left is killed; the groups go."""
        for folder in self.folders.values():
            for _ in range(50):
                try:
                    pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    folder.rmdir()
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        break
                    time.sleep(0.1)


def _pairs(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


class CappedLog:
    """A run's output into its log: the first ``keep`` bytes, then only the last ``keep`` are kept, and
    the log says how much was cut between. A full disk stops the writing, not the run or the runner."""

    def __init__(self, path: Path, keep: int):
        self.path, self.keep = path, keep
        self.cut = 0
        self.error: str | None = None
        self._file = open(path, "wb")
        self._written = 0
        self._tail = bytearray()
        self.thread: threading.Thread | None = None

    def follow(self, stream) -> None:
        """Copies ``stream`` (the run's stdout) on a thread of its own until it ends."""
        self.thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self.thread.start()

    def _copy(self, stream) -> None:
        with stream:
            while data := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
                self._take(data)
        self._finish()

    def _take(self, data: bytes) -> None:
        room = max(0, self.keep - self._written) if self.keep else len(data)
        head, rest = data[:room], data[room:]
        if head:
            self._write(head)
            self._written += len(head)
        if rest:
            self._tail += rest
            if len(self._tail) > self.keep:
                self.cut += len(self._tail) - self.keep
                del self._tail[:len(self._tail) - self.keep]

    def _write(self, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            self.error = f"the log could not be written: {exc}"

    def _finish(self) -> None:
        if self.cut:
            self._write(f"\n[stepmill: {self.cut} bytes of this run's output cut here; the first and the last "
                        f"{self.keep} are kept]\n".encode())
        self._write(bytes(self._tail))
        try:
            self._file.close()
        except OSError as exc:
            self.error = self.error or f"the log could not be written: {exc}"

    def wait(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
