"""Helper processes (a proxy, the simulated LLM, the UI): a free port for each, and none outlives the
command that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        return None


# Looked up once, in the parent: a ``preexec_fn`` runs between fork and exec of a process with threads,
# where a dlopen (ctypes.CDLL) could wait forever on a loader lock another thread held at the fork.
prctl = _libc_prctl()


# The pid of the process that last forked, as its child sees it: a ``preexec_fn`` compares it with its
# parent now, for a parent killed between the fork and the prctl never sends the signal.
_forker = os.getpid()


def _note_forker() -> None:
    global _forker
    _forker = os.getpid()


os.register_at_fork(before=_note_forker)

_given: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and never one this process was given before: two calls in a
    row may otherwise get the same port (a proxy's listen and control ports, before either listens)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """A ``preexec_fn``: on Linux the child gets ``sig`` when its parent dies, even by kill -9 (without
    prctl, the parent's own cleanup still stops the child)."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != _forker:  # the parent died before the prctl took: nothing will ever signal
            os._exit(128 + sig)


def wait_up(answers, process: subprocess.Popen, what: str, log, timeout: float = 60) -> None:
    """Until ``answers()`` stops raising OSError; the process killed and RuntimeError when it exits or
    the timeout passes."""
    deadline = time.time() + timeout
    while True:
        if process.poll() is not None:  # whatever answers on its port now is not it
            raise RuntimeError(f"{what} exited with {process.returncode} (its log: {log})")
        try:
            answers()
            return
        except OSError:
            if time.time() > deadline:
                process.kill()
                raise RuntimeError(f"{what} does not answer (its log: {log})") from None
            time.sleep(0.2)
