"""Commands around capture: run the proxy, point agents at it, its token, its addon, the policy version."""

from __future__ import annotations

import os
import shlex
import sys

import click

from stepmill import __version__
from stepmill.cli.options import address_options, confdir_option, db_option
from stepmill.cli.proxy_args import Listener, listeners, take_own_options
from stepmill.cli.stores import open_writer


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@address_options(8080, port_help="Proxy port.", host_help="Address to listen on.")
@click.option("--control-port", type=int, default=None,
              help="Also answer the control API directly on this port (default: none; it is always "
                   "reachable as http://stepmill.local through the proxy).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Proxy processes accepting on the same ports, each with its own journal and writer "
                   "(default: one per core but one, at most 8). 1: one process, as without workers.")
@db_option
@confdir_option
@click.argument("mitmproxy_args", nargs=-1, type=click.UNPROCESSED)
def proxy(port, host, control_port, workers, db, confdir, mitmproxy_args):
    """Run mitmproxy with the stepmill addon.

    Extra arguments go to mitmdump as they are: more `-s` scripts, `--set name=value`,
    `--mode reverse:https://api.openai.com` for agents that only take a base URL,
    `--mode upstream:http://corp-proxy:3128`. `--set confdir=…`, `--set stepmill_db=…`,
    `--set listen_host=…` and `--set listen_port=…` (and mitmdump's `--listen-host`, `--listen-port`, `-p`)
    are the same as `--confdir`, `--db`, `--host`, `--port`.
    """
    from stepmill.auth.write_token import ENV, ensure_token, token_path
    from stepmill.protocols import registry
    from stepmill.proxy_supervisor import default_workers, supervise
    from stepmill.runner.proxy_env import ensure_bundle, ensure_ca

    registry.load()  # a broken protocol plugin stops the proxy here, with its entry point named
    extra, own = take_own_options(list(mitmproxy_args))
    db, confdir, host = own.get("db", db), own.get("confdir", confdir), own.get("host", host)
    try:
        port = int(own.get("port", port))
    except ValueError:
        raise click.BadParameter(f"listen_port must be a number, not {own['port']!r}") from None
    ca = ensure_ca(confdir)
    bundle = ensure_bundle(confdir)
    ensure_token(confdir)
    args = ["--set", f"stepmill_db={db}", "--set", f"confdir={confdir}",
            "--listen-host", host, "--listen-port", str(port)]
    if not any(a == "--mode" or a.startswith("--mode=") or a == "-m" for a in extra):
        args += ["--mode", f"regular@{port}"]
    control_spec = f"reverse:http://stepmill.local@{control_port}" if control_port else None
    if control_spec:
        args += ["--mode", control_spec]
    if not any("flow_detail" in a for a in extra):
        args += ["--set", "flow_detail=0"]  # no line per flow on the console (pass --set flow_detail=1 for it)
    # The addon comes after the user's scripts (it is part of the master's chain): it sees, and
    # records, requests as they go upstream.
    args = args + extra
    workers = workers or default_workers()
    modes = listeners(args, host, port)
    shared = _bind_listeners(modes, workers) if workers > 1 else {}
    click.echo(f"stepmill {__version__}: steps in {db}" + (f", {workers} worker processes" if workers > 1 else ""),
               err=True)
    for line in listening_lines(modes, control_spec, confdir):
        click.echo(line, err=True)
    click.echo(f"mitmproxy CA: {ca}", err=True)
    click.echo(f"trust bundle (system CAs + mitmproxy CA): {bundle}", err=True)
    click.echo(f"write token for the control API: {'$' + ENV if os.environ.get(ENV) else token_path(confdir)}"
               " (never give it to agents)", err=True)
    if workers > 1:
        sys.exit(supervise(args, workers, shared))
    from stepmill.proxy_master import run  # here only: the supervisor above serves nothing, and stays small

    sys.exit(run(args) or 0)


def _url_host(host: str) -> str:
    """A listening host as a client reaches it: every address is reachable on loopback."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def listening_lines(modes: list[Listener], control_spec: str | None, confdir: str) -> list[str]:
    """For each mode, where it listens and how an agent uses it: the addresses mitmproxy will bind."""
    from stepmill.runner.proxy_env import DEFAULT_CONFDIR

    lines = []
    for listener in sorted(modes, key=lambda listener: listener.spec == control_spec):  # the control API last
        kind, at = listener.mode.type_name, _url_host(listener.host)
        where = f"http://{at}:{listener.port}" if listener.port is not None else "no port"
        if listener.host in ("", "0.0.0.0", "::"):
            where += " (every address)"
        if listener.spec == control_spec:
            lines.append(f"control API on {where}")
        elif kind in ("regular", "upstream"):
            through = f" to the upstream proxy {listener.mode.data}" if kind == "upstream" else ""
            lines.append(f"proxy{through} on {where}")
            options = ("" if at == "127.0.0.1" else f" --host {at.strip('[]')}") + f" --port {listener.port}"
            if confdir != DEFAULT_CONFDIR:
                options += f" --confdir {shlex.quote(confdir)}"
            lines.append(f'agents: eval "$(stepmill env{options})"')
        elif kind == "reverse":
            lines.append(f"reverse proxy to {listener.mode.data} on {where}")
            lines.append(f"agents: OPENAI_BASE_URL=http://{at}:{listener.port}/v1 (tagged: "
                         f"http://{at}:{listener.port}/t/<trajectory>/g/<group>/v1)")
        else:
            lines.append(f"{kind} mode ({listener.spec})" + (f" on {at}:{listener.port}" if listener.port else ""))
    return lines


def _bind_listeners(modes: list[Listener], workers: int) -> dict:
    """The TCP listeners the workers share, bound here (once, held by the supervisor): each mode must
    have a fixed TCP port, and a port already taken fails now, before any worker starts."""
    from stepmill.proxy_supervisor import bind_listener

    shared = {}
    for listener in modes:
        if listener.mode.transport_protocol not in ("tcp", "both"):  # both: its UDP side (HTTP/3) in the first worker
            raise click.UsageError(f"--workers {workers}: mode {listener.spec!r} is not TCP; run it with --workers 1")
        if not listener.port:
            raise click.UsageError(f"--workers {workers} needs a fixed port for mode {listener.spec!r}, not 0")
        try:
            shared[f"{listener.host}:{listener.port}"] = bind_listener(listener.host, listener.port)
        except OSError as exc:
            raise click.UsageError(f"port {listener.port} is taken ({exc}): is a proxy already running there?") \
                from None
    return shared


@click.command()
@address_options(8080)
@click.option("--trajectory", help="Tag every call of this shell with a trajectory id (proxy credentials).")
@click.option("--group", help="... and a group id (GRPO).")
@confdir_option
def env(port, host, trajectory, group, confdir):
    """Print the shell exports that send an agent through the proxy: eval "$(stepmill env)"."""
    from stepmill.runner.proxy_env import agent_env

    for name, value in agent_env(host, port, confdir, trajectory, group).items():
        click.echo(f"export {name}={shlex.quote(value)}")


@click.command("addon-path")
def addon_path():
    """Path of the addon script, for `mitmdump -s`."""
    from stepmill.addon import SCRIPT

    click.echo(SCRIPT)


@click.command()
@confdir_option
@click.option("--path", "show_path", is_flag=True, help="Print where the token is kept instead of the token.")
def token(confdir, show_path):
    """Print the control API's write token, for a trainer or an app (never for an agent).

    It is created on the proxy's first start; STEPMILL_TOKEN, when set, is the token instead.
    """
    from stepmill.auth.write_token import ENV, ensure_token, token_path

    if show_path:
        click.echo(f"${ENV}" if os.environ.get(ENV) else token_path(confdir))
        return
    click.echo(ensure_token(confdir))


@click.command("policy-version")
@db_option
@click.argument("version", required=False)
def policy_version(db, version):
    """Show or set the policy version stamped on steps captured from now on."""
    store = open_writer(db)
    if version is not None:
        store.set_policy_version(version)
    click.echo(store.policy_version() or "")


COMMANDS = [proxy, env, addon_path, token, policy_version]
