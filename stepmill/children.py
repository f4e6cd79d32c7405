"""Helper processes (a proxy, the simulated LLM, the UI): a free port for each, and none outlives the
command that started it."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """A ``preexec_fn``: on Linux the child gets SIGTERM when its parent dies, even by kill -9."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass  # no prctl: the parent's own cleanup still stops the child
