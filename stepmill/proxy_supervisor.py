"""The supervisor of `stepmill proxy --workers N`: it binds the listening sockets once, starts N
workers (``python -m stepmill.proxy_master``) that accept on them, restarts one that dies, and stops them
all on SIGINT/SIGTERM.

It serves nothing itself, so it imports none of mitmproxy's proxy, the addon's hooks (only the
workers' private channel, ``stepmill.addon.siblings``) or the store: it stays a
small process beside its workers (bench/idle_rss.py measures it).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from stepmill.addon import siblings
from stepmill.children import die_with_parent

LISTENERS_ENV = "STEPMILL_LISTENERS"  # "host:port=fd,…": the listening sockets a worker inherits


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket the supervisor holds and every worker accepts on. It is bound without
    SO_REUSEPORT: no other process (an agent of the same user included) can join the port and take a
    share of its connections, and a second proxy on the same port fails instead of joining."""
    family = socket.AF_INET6 if ":" in host or not host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, as asyncio does
        if not host:  # as mitmproxy: every address, both stacks
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind((host or "::", port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener


MAX_WORKERS = 8  # the default's cap: one SQLite file takes every worker's commits, one writer at a time
STOP_WAIT = 30.0  # seconds workers have to drain their writers after SIGTERM, then they are killed
RESTARTS = 5  # restarts within RESTART_WINDOW seconds at most; past it the proxy stops
RESTART_WINDOW = 60.0


def default_workers() -> int:
    """One per core but one, at most MAX_WORKERS: the spare core runs the writers, which parse and
    commit every call, and the agents. On two cores a second worker serves no more streamed calls and
    costs each about a fifth more CPU (docs/fleet/workers.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores - 1, MAX_WORKERS))


def _die_with_parent() -> None:
    """In a worker, before exec: killed (as a kill -9 of the one proxy process would be) if the supervisor dies."""
    die_with_parent(signal.SIGKILL)


class Supervisor:
    """Starts the workers, restarts one that dies, stops them all on SIGINT/SIGTERM.

    A worker that dies after it started serving (killed, out of memory) is started again: the new one
    replays the journal its predecessor left, so its finished calls are kept, and the others serve
    meanwhile. One that dies before it served (a bad option, a port taken) stops the proxy, with its
    exit status: starting it again would fail the same way. So do too many restarts in a row."""

    def __init__(self, arguments: list[str], count: int, listeners: dict[str, socket.socket]):
        self.arguments = arguments
        self.count = count
        self.listeners = listeners  # "host:port" -> the socket every worker accepts on (held here, for restarts)
        self.folder = tempfile.mkdtemp(prefix="stepmill-workers-")  # 0700: the private channel's sockets
        self.processes: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.restarts: list[float] = []
        self.stopping = False

    def _start(self, worker: int) -> None:
        env = {**os.environ, siblings.ENV_DIR: self.folder, siblings.ENV_ID: str(worker),
               siblings.ENV_COUNT: str(self.count),
               LISTENERS_ENV: ",".join(f"{key}={s.fileno()}" for key, s in self.listeners.items())}
        self.started[worker] = time.time()
        self.processes[worker] = subprocess.Popen([sys.executable, "-m", "stepmill.proxy_master", *self.arguments],
                                                  env=env, process_group=0, preexec_fn=_die_with_parent,
                                                  pass_fds=[s.fileno() for s in self.listeners.values()])

    def _served(self, worker: int) -> bool:
        """Whether the worker got as far as its private channel (made after its listeners)."""
        try:
            return siblings.socket_path(self.folder, worker).stat().st_mtime >= self.started[worker] - 1
        except OSError:
            return False

    def _stop_all(self, signum: int = signal.SIGTERM) -> None:
        self.stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def _wait(self, wakeup: int) -> None:
        """Until a worker exits or a signal comes (its number is written to ``wakeup``'s pipe): the
        supervisor takes no CPU while its workers serve. Without pidfds (Linux < 5.3), a look every 0.2 s."""
        exits: list[int] = []
        try:
            try:
                for process in self.processes.values():
                    if process.returncode is None:
                        exits.append(os.pidfd_open(process.pid))
            except (AttributeError, OSError):  # the pidfds opened so far are closed below
                time.sleep(0.2)
                return
            ready, _, _ = select.select([wakeup, *exits], [], [])
            if wakeup in ready:
                os.read(wakeup, 512)
        finally:
            for fd in exits:
                os.close(fd)

    def run(self) -> int:
        status = 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self._stop_all())
        wakeup, wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
        try:
            for worker in range(self.count):
                self._start(worker)
            while not self.stopping:
                self._wait(wakeup)
                for worker, process in list(self.processes.items()):
                    code = process.poll()
                    if code is None or self.stopping:
                        continue
                    now = time.time()
                    self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW]
                    if not self._served(worker) or len(self.restarts) >= RESTARTS:
                        why = "before it served" if not self._served(worker) else f"{RESTARTS} restarts in a row"
                        print(f"stepmill: worker {worker} exited with {code} {why}; stopping the proxy",
                              file=sys.stderr, flush=True)
                        status = code or 1
                        self._stop_all()
                        break
                    print(f"stepmill: worker {worker} (pid {process.pid}) exited with {code}; starting it again",
                          file=sys.stderr, flush=True)
                    self.restarts.append(now)
                    self._start(worker)
            deadline = time.monotonic() + STOP_WAIT
            for process in self.processes.values():
                try:
                    code = process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    code = process.wait()
                if code and code != -signal.SIGTERM and not status:
                    status = code if code > 0 else 1
            return status
        finally:
            self._stop_all(signal.SIGKILL)
            shutil.rmtree(self.folder, ignore_errors=True)
            signal.set_wakeup_fd(-1)
            os.close(wakeup)
            os.close(wakeup_w)


def supervise(arguments: list[str], count: int, listeners: dict[str, socket.socket]) -> int:
    """``count`` workers running mitmdump's command line ``arguments``, accepting on ``listeners``
    ("host:port" -> a socket from ``bind_listener``); the exit status of the proxy."""
    return Supervisor(arguments, count, listeners).run()
