"""`stepmill proxy`'s own mitmproxy master: mitmdump's addons and options, dispatched leanly.

mitmproxy calls every event (about twenty per flow: connection, TLS, request, response, update
…) on every addon in its chain, each call wrapped in a generator context manager and a
coroutine, whether the addon handles the event or not. With its thirty-odd default addons that
dispatch is most of what a proxied call costs. This master keeps mitmdump's addons, options and
command line exactly (anything a user passes still works), and dispatches each event through a
table of the callables that handle it, rebuilt whenever an addon is added, removed or loaded.
The same table serves the synchronous ``trigger`` (options, log entries). mitmproxy also turns
every log record, debug ones included, into a deprecated ``add_log`` event (formatted, and
scheduled on the loop through a wake-up pipe); here that happens only while an addon handles it.
The stepmill addon is part of the chain (after the user's scripts), not a script.

``supervise`` runs N such masters as worker processes (``stepmill proxy --workers N``), each accepting
on the same listening sockets (bound once by the supervisor and inherited: nobody else can join the
port) with its own journal and writer; the workers talk over a private channel
(``stepmill.addon.siblings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from mitmproxy import addonmanager, addons, ctx, exceptions, hooks, master
from mitmproxy import log as mitmproxy_log
from mitmproxy.addons import dumper, errorcheck, keepserving, readfile
from mitmproxy.proxy import events, layer, mode_servers
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.utils import expect

from stepmill.addon import siblings
from stepmill.addon.main import StepmillAddon
from stepmill.children import die_with_parent

log = logging.getLogger(__name__)


class LeanAddonManager(addonmanager.AddonManager):
    def __init__(self, master_):
        super().__init__(master_)
        self._table: dict[str, list] = {}

    # Every way the chain changes (scripts load and reload through register/remove) clears the table,
    # after the change too: registering triggers events (configure) while the chain is half-built.
    @contextlib.contextmanager
    def _changing(self):
        self._table.clear()
        try:
            yield
        finally:
            self._table.clear()

    def register(self, addon):
        with self._changing():
            return super().register(addon)

    def remove(self, addon):
        with self._changing():
            super().remove(addon)

    def add(self, *items):
        with self._changing():
            super().add(*items)

    def clear(self):
        with self._changing():
            super().clear()

    def _handlers(self, event: hooks.Hook) -> list:
        handlers = self._table.get(event.name)
        if handlers is None:
            handlers = [pair for addon in self.chain for pair in self._iter_hooks(addon, event)]
            self._table[event.name] = handlers
        return handlers

    def handles(self, event: hooks.Hook) -> bool:
        return bool(self._handlers(event))

    def trigger(self, event: hooks.Hook):
        args = event.args()
        for addon, func in self._handlers(event):
            try:
                if inspect.iscoroutinefunction(func):
                    raise exceptions.AddonManagerError(
                        f"Async handler {event.name} ({addon}) cannot be called from sync context")
                func(*args)
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception as exc:  # as mitmproxy's safecall
                log.error(f"Addon error: {exc}", exc_info=True)

    async def trigger_event(self, event: hooks.Hook):
        args = event.args()
        for addon, func in self._handlers(event):
            try:
                result = func(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception as exc:  # what mitmproxy's safecall does: log, and go on with the next addon
                log.error(f"Addon error: {exc}", exc_info=True)


class LeanLogEvents(mitmproxy_log.LegacyLogEvents):
    """``add_log`` events only while some addon has an ``add_log`` hook."""

    _probe = mitmproxy_log.AddLogHook(mitmproxy_log.LogEntry("", "debug"))

    def emit(self, record):
        if self.master.addons.handles(self._probe):
            super().emit(record)


class ControlListener(modes.ReverseProxy):
    """The top layer of the ``--control-port`` listener (a reverse mode to http://stepmill.local).

    The addon answers every request there, so nothing is dialled first: ReverseProxy under mitmproxy's
    default ``connection_strategy=eager`` opens the upstream connection as the client connects, and
    stepmill.local has no address, so the client got an empty reply."""

    @expect(events.Start)
    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        self.context.server.address = self.context.client.proxy_mode.address  # as ReverseProxy, never opened
        self.child_layer = layer.NextLayer(self.context)
        self._handle_event = self.child_layer.handle_event
        yield from self.child_layer.handle_event(event)


_reverse_top_layer = mode_servers.ReverseInstance.make_top_layer


def _top_layer(instance: mode_servers.ReverseInstance, context) -> layer.Layer:
    stepmill = getattr(ctx.master, "stepmill", None)  # only under this master; other reverse modes as ever
    if stepmill is not None and stepmill.control.is_control_mode(instance.mode):
        return ControlListener(context)
    return _reverse_top_layer(instance, context)


class StepmillMaster(master.Master):
    def __init__(self, opts, event_loop=None, with_termlog: bool = True):
        super().__init__(opts, event_loop=event_loop, with_termlog=False)
        self.addons = LeanAddonManager(self)
        self._legacy_log_events.uninstall()  # after the new manager: the lean events ask it who listens
        self._legacy_log_events = LeanLogEvents(self)
        self._legacy_log_events.install()
        if with_termlog:
            from mitmproxy.addons import termlog

            self._termlog_addon = termlog.TermLog()
            self.addons.add(self._termlog_addon)
        self.addons.add(*addons.default_addons())
        self.addons.add(dumper.Dumper(), keepserving.KeepServing(), readfile.ReadFileStdin(),
                        errorcheck.ErrorCheck())
        self.stepmill = StepmillAddon()
        self.addons.add(self.stepmill)
        # mitmproxy makes a listener's top layer with no hook in between: the control listener's is ours.
        mode_servers.ReverseInstance.make_top_layer = _top_layer


def run(arguments: list[str]) -> None:
    """mitmdump's command line, with this master."""
    from mitmproxy.tools import cmdline
    from mitmproxy.tools.main import run as run_master

    run_master(StepmillMaster, cmdline.mitmdump, arguments)


# -- one of several workers ---------------------------------------------------------------------------
_listen = mode_servers.AsyncioServerInstance.listen


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


def _inherited() -> dict[str, int]:
    value = os.environ.get(LISTENERS_ENV, "")
    return {key: int(fd) for key, _, fd in (item.rpartition("=") for item in value.split(",") if item)}


async def _listen_shared(self: mode_servers.AsyncioServerInstance, host: str, port: int):
    """mitmproxy's listen, on the socket the supervisor bound for this TCP port: every worker accepts
    there. A mode that also listens on UDP (reverse to https: HTTP/3) has that in the first worker only."""
    protocol = self.mode.transport_protocol
    fd = _inherited().get(f"{host}:{port}")
    if protocol not in ("tcp", "both") or fd is None:
        return await _listen(self, host, port)
    servers = [await asyncio.start_server(self.handle_stream, sock=socket.socket(fileno=os.dup(fd)))]
    if protocol == "both" and os.environ.get(siblings.ENV_ID) == "0":
        if host == "":  # as mitmproxy: both stacks
            servers.append(await self.start_udp_based_server("0.0.0.0", port))
            with contextlib.suppress(Exception):
                servers.append(await self.start_udp_based_server("::", port))
        else:
            servers.append(await self.start_udp_based_server(host, port))
    return servers


def run_worker(arguments: list[str]) -> None:
    """A worker of ``supervise`` (``python -m stepmill.proxy_master``): the master, its listeners shared."""
    mode_servers.AsyncioServerInstance.listen = _listen_shared
    run(arguments)


MAX_WORKERS = 8  # the default's cap: one SQLite file takes every worker's commits, one writer at a time
STOP_WAIT = 30.0  # seconds workers have to drain their writers after SIGTERM, then they are killed
RESTARTS = 5  # restarts within RESTART_WINDOW seconds at most; past it the proxy stops
RESTART_WINDOW = 60.0


def default_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                      MAX_WORKERS))


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

    def run(self) -> int:
        status = 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self._stop_all())
        try:
            for worker in range(self.count):
                self._start(worker)
            while not self.stopping:
                time.sleep(0.2)
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


def supervise(arguments: list[str], count: int, listeners: dict[str, socket.socket]) -> int:
    """``count`` workers running mitmdump's command line ``arguments``, accepting on ``listeners``
    ("host:port" -> a socket from ``bind_listener``); the exit status of the proxy."""
    return Supervisor(arguments, count, listeners).run()


if __name__ == "__main__":
    run_worker(sys.argv[1:])
