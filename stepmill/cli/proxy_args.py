"""Which of mitmdump's arguments `stepmill proxy` sets itself, and taking them out of the rest."""

from __future__ import annotations

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
