"""`stepmill proxy`'s own mitmproxy master: mitmdump's addons and options, dispatched leanly.

mitmproxy calls every event (about twenty per flow: connection, TLS, request, response, update
…) on every addon in its chain, each call wrapped in a generator context manager and a
coroutine, whether the addon handles the event or not. With its thirty-odd default addons that
dispatch is most of what a proxied call costs. This master keeps mitmdump's addons, options and
command line exactly (anything a user passes still works), and dispatches each event through a
table of the callables that handle it, rebuilt whenever an addon is added, removed or loaded.
The same table serves the synchronous ``trigger`` (options, log entries). Option reads and new messages
skip two copies and a debug-only check (``_lean_mitmproxy``). mitmproxy also turns
every log record, debug ones included, into a deprecated ``add_log`` event (formatted, and
scheduled on the loop through a wake-up pipe); here that happens only while an addon handles it.
The stepmill addon is part of the chain (after the user's scripts), not a script.

``stepmill.proxy_supervisor`` runs N such masters as worker processes (``stepmill proxy --workers N``),
each accepting on the same listening sockets (bound once by the supervisor and inherited: nobody else
can join the port) with its own journal and writer; the workers talk over a private channel
(``stepmill.addon.siblings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import socket
import sys

from stepmill import proxy_onboarding

proxy_onboarding.defer()  # before mitmproxy's addons: their mitm.it page (Flask) loads when first asked for

from mitmproxy import addonmanager, addons, ctx, exceptions, flow, hooks, http, master, optmanager  # noqa: E402
from mitmproxy import log as mitmproxy_log  # noqa: E402
from mitmproxy.addons import dumper, errorcheck, keepserving, readfile  # noqa: E402
from mitmproxy.proxy import events, layer, mode_servers  # noqa: E402
from mitmproxy.proxy.layers import modes  # noqa: E402
from mitmproxy.proxy.utils import expect  # noqa: E402

from stepmill.addon import siblings  # noqa: E402
from stepmill.addon.main import StepmillAddon  # noqa: E402
from stepmill.proxy_supervisor import LISTENERS_ENV  # noqa: E402

log = logging.getLogger(__name__)


_ARG_NAMES: dict[type, tuple[str, ...]] = {}


def _args(event: hooks.Hook) -> list:
    """``event.args()``, its fields' names looked up once per kind of event (dataclasses.fields is slow)."""
    names = _ARG_NAMES.get(type(event))
    if names is None:
        names = _ARG_NAMES[type(event)] = tuple(field.name for field in dataclasses.fields(event))
    return [getattr(event, name) for name in names]


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

    _update_probe = hooks.UpdateHook([])

    async def handle_lifecycle(self, event: hooks.Hook):
        """As mitmproxy's, but the ``update`` event that follows every flow event is made only while an
        addon handles it (none of mitmdump's do)."""
        await self.trigger_event(event)
        if self.handles(self._update_probe):
            message = _args(event)[0]
            if isinstance(message, flow.Flow):
                await self.trigger_event(hooks.UpdateHook([message]))

    def trigger(self, event: hooks.Hook):
        args = _args(event)
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
        args = _args(event)
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


class PerFlowLines(logging.Filter):
    """Keeps mitmproxy's connection-by-connection information lines (client and server connects,
    "Streaming response from …": one or more per call, thousands a minute under load) off the console
    while ``flow_detail`` is 0, as it is by default under ``stepmill proxy``; their warnings and errors,
    and every other logger's lines (stepmill's own, mitmproxy's start-up), still show."""

    PER_CONNECTION = "mitmproxy.proxy.server"  # the logger of every layer's per-connection lines

    def __init__(self, options):
        super().__init__()
        self.options = options

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or record.name != self.PER_CONNECTION
                or getattr(self.options, "flow_detail", 0) > 0)  # the option exists once the dumper loaded


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


_ATOMIC = (type(None), bool, int, float, str, bytes)


def _current(option: optmanager._Option):
    """mitmproxy's ``_Option.current``, without the two deep copies of an immutable value (what
    ``copy.deepcopy`` gives for one is the value itself): every option read on every event made them."""
    value = option._default if option.value is optmanager.unset else option.value
    return value if type(value) in _ATOMIC else copy.deepcopy(value)


def _lean_mitmproxy() -> None:
    """Two of mitmproxy's costs per flow, about 6% of the event loop's CPU, taken out in this process:
    option reads deep-copied immutable values (``_current``), and each request and response checked its
    fields' types at construction, a check of its own code that mitmproxy makes only under
    ``if __debug__`` (it is off under ``python -O``)."""
    optmanager._Option.current = _current
    if "__post_init__" in vars(http.MessageData):
        http.MessageData.__post_init__ = lambda self: None  # the dataclasses' __init__ calls it by name


class StepmillMaster(master.Master):
    def __init__(self, opts, event_loop=None, with_termlog: bool = True):
        _lean_mitmproxy()
        super().__init__(opts, event_loop=event_loop, with_termlog=False)
        self.addons = LeanAddonManager(self)
        self._legacy_log_events.uninstall()  # after the new manager: the lean events ask it who listens
        self._legacy_log_events = LeanLogEvents(self)
        self._legacy_log_events.install()
        if with_termlog:
            from mitmproxy.addons import termlog

            self._termlog_addon = termlog.TermLog()
            self._termlog_addon.logger.addFilter(PerFlowLines(opts))
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


if __name__ == "__main__":
    run_worker(sys.argv[1:])
