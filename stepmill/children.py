"""Helper processes (a proxy, the simulated LLM, the UI): a free port for each, and none outlives the
command that started it."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        return None


# Looked up once, in the parent: a ``preexec_fn`` runs between fork and exec of a process with threads,
# where a dlopen (ctypes.CDLL) could wait forever on a loader lock another thread held at the fork.
prctl = _libc_prctl()


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
