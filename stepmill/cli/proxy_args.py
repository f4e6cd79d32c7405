"""Which of mitmdump's arguments `stepmill proxy` sets itself, taking them out of the rest, and where
the modes they ask for listen."""

from __future__ import annotations

from typing import Any, NamedTuple

# Options `stepmill proxy` sets itself: given again with --set, the user's value is taken.
OWN_OPTIONS = {"confdir": "confdir", "stepmill_db": "db", "listen_host": "host", "listen_port": "port"}


# mitmdump's own flags for two of them: `stepmill proxy --listen-port 9000` listens on 9000.
OWN_FLAGS = {"--listen-host": "host", "--listen-port": "port", "-p": "port"}


def take_own_options(extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull the options `stepmill proxy` sets itself (``--set name=value``, ``--listen-host``,
    ``--listen-port``/``-p``) out of mitmdump's arguments."""
    rest, taken, i = [], {}, 0
    while i < len(extra):
        arg = extra[i]
        value = None
        flag, eq, inline = arg.partition("=")
        if arg in OWN_FLAGS and i + 1 < len(extra):
            taken[OWN_FLAGS[arg]] = extra[i + 1]
            i += 2
            continue
        if eq and flag in OWN_FLAGS and flag.startswith("--"):
            taken[OWN_FLAGS[flag]] = inline
            i += 1
            continue
        if arg == "--set" and i + 1 < len(extra):
            value, step = extra[i + 1], 2
        elif arg.startswith("--set="):
            value, step = arg[len("--set="):], 1
        if value is not None and value.partition("=")[0] in OWN_OPTIONS and "=" in value:
            name, _, setting = value.partition("=")
            taken[OWN_OPTIONS[name]] = setting
            i += step
            continue
        rest.append(arg)
        i += 1
    return rest, taken


class Listener(NamedTuple):
    """One ``--mode`` of mitmdump's arguments and the address it listens on."""

    spec: str
    mode: Any  # mitmproxy's ProxyMode
    host: str  # "" is every address
    port: int | None  # None: the mode listens on no port (local)


def listeners(args: list[str], host: str, port: int) -> list[Listener]:
    """The modes mitmdump's arguments ask for, each with where it listens (mitmproxy's defaults from
    ``--listen-host``/``--listen-port``, here ``host`` and ``port``). A spec mitmproxy cannot parse is
    left out: mitmproxy says what is wrong with it when it starts."""
    from mitmproxy.proxy import mode_specs

    specs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--mode", "-m")]
    specs += [a.partition("=")[2] for a in args if a.startswith("--mode=")]
    found = []
    for spec in specs:
        try:
            mode = mode_specs.ProxyMode.parse(spec)
        except ValueError:
            continue
        found.append(Listener(spec, mode, mode.listen_host(host), mode.listen_port(port)))
    return found
