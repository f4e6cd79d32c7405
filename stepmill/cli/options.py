"""Options several commands share, each written once: the database, mitmproxy's directory, an
address to listen on or connect to, and a ``--where`` condition with its ``-p`` parameters."""

from __future__ import annotations

import click

db_option = click.option("--db", default="stepmill.db", show_default=True, envvar="STEPMILL_DB",
                         type=click.Path(dir_okay=False), help="SQLite file holding the steps.")
confdir_option = click.option("--confdir", default="~/.mitmproxy", show_default=True,
                              help="mitmproxy's directory (its CA and stepmill's write token live there).")

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
    """The user's condition, parenthesised so it combines safely, and its named parameters."""
    return (f"({where})" if where else None), dict(params)
