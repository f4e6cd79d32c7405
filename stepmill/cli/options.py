"""Options several commands share, each written once: the database (one file, several, or one a
rollout's configuration may name), mitmproxy's directory, the fleet's coordinator, ``--json``, an
address to listen on or connect to, a ``--where`` condition with its ``-p`` parameters, choices the
store defines, and what a command says when Ctrl-C stops it."""

from __future__ import annotations

import click


def _db(*names: str, **settings):
    return click.option("--db", *names, type=click.Path(dir_okay=False), **settings)


db_option = _db(default="stepmill.db", show_default=True, envvar="STEPMILL_DB", help="SQLite file holding the steps.")
dbs_option = _db("dbs", multiple=True, default=("stepmill.db",), show_default=True, envvar="STEPMILL_DB",
                 help="SQLite file holding the steps; repeat it to browse several (a fleet's nodes' files: copies, "
                      "or a shared filesystem).")
config_db_option = _db(default=None, help="SQLite file holding the steps (default: [proxy] db in the configuration, "
                                          "else stepmill.db).")
confdir_option = click.option("--confdir", default="~/.mitmproxy", show_default=True,
                              help="mitmproxy's directory (its CA and stepmill's write token live there).")
coordinator_option = click.option("--coordinator", envvar="STEPMILL_COORDINATOR",
                                  help="The fleet's coordinator, a PostgreSQL URL postgresql://… "
                                       "(default $STEPMILL_COORDINATOR).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")

STEPS_WHERE_HELP = "SQL condition on the steps table (alias s), e.g. \"s.status = 'ok'\"."


def address_options(port: int, *, port_help: str | None = None, host_help: str | None = None):
    """``--port`` (default ``port``) and ``--host`` (default 127.0.0.1)."""
    def decorate(command):
        command = click.option("--host", default="127.0.0.1", show_default=True, help=host_help)(command)
        return click.option("--port", default=port, show_default=True, help=port_help)(command)

    return decorate


def where_options(where_help: str = STEPS_WHERE_HELP):
    """``--where`` (its help says which table and alias) and ``-p/--param`` pairs, given as ``where``
    and ``params``."""
    def decorate(command):
        command = click.option("-p", "--param", "params", multiple=True, type=(str, str),
                               help="A named parameter for --where: -p model qwen with --where \"s.model = :model\".")(
            command)
        return click.option("--where", help=where_help)(command)

    return decorate


def where_clause(where: str | None, params: tuple) -> tuple[str | None, dict]:
    """The user's condition (None for none; the store parenthesises it where it combines it with
    its own) and its named parameters."""
    return where or None, dict(params)


class CurationChoice(click.Choice):
    """One of the values ``stepmill.store.curation`` defines (``SOURCES``, ``LABELS``), looked up when
    first needed: importing the store when the command starts would slow every ``stepmill`` command."""

    def __init__(self, name: str):
        self.name_in_store = name
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:
        from stepmill.store import curation

        return tuple(getattr(curation, self.name_in_store))


def stop_on_signals() -> None:
    """Ctrl-C and a plain kill stop a long command cleanly (its children stopped, what ran kept), also
    where the shell started it with SIGINT ignored: both raise KeyboardInterrupt."""
    import faulthandler
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where every thread is, on stderr


def on_interrupt(message: str):
    """What the command says when Ctrl-C (or a signal it turns into one) stops it, after its own
    clean-up ran; ``StepmillGroup`` prints it and exits with status 130. Put it above ``@click.command``."""
    def decorate(command: click.Command) -> click.Command:
        command.interrupted = message
        return command

    return decorate
