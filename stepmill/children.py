"""Helper processes (a proxy, the simulated LLM, the UI): a free port for each, and none outlives the
command that started it."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1


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


def die_with_parent() -> None:
    """A ``preexec_fn``: on Linux the child gets SIGTERM when its parent dies, even by kill -9."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass  # no prctl: the parent's own cleanup still stops the child
