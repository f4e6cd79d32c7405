"""Commands around capture: run the proxy, point agents at it, its token, its addon, the policy version."""

from __future__ import annotations

import os
import shlex
import sys

import click

from stepmill import __version__
from stepmill.cli.options import address_options, confdir_option, db_option
from stepmill.cli.proxy_args import take_own_options
from stepmill.cli.stores import open_writer


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@address_options(8080, port_help="Proxy port.", host_help="Address to listen on.")
@click.option("--control-port", type=int, default=None,
              help="Also answer the control API directly on this port (default: none; it is always "
                   "reachable as http://stepmill.local through the proxy).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Proxy processes accepting on the same ports, each with its own journal and writer "
                   "(default: one per core, at most 8). 1: one process, as without workers.")
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
    from stepmill.proxy_master import default_workers, run, supervise
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
    if control_port:
        args += ["--mode", f"reverse:http://stepmill.local@{control_port}"]
    if not any("flow_detail" in a for a in extra):
        args += ["--set", "flow_detail=0"]  # no line per flow on the console (pass --set flow_detail=1 for it)
    # The addon comes after the user's scripts (it is part of the master's chain): it sees, and
    # records, requests as they go upstream.
    args = args + extra
    workers = workers or default_workers()
    listeners = _bind_listeners(args, host, port, workers) if workers > 1 else {}
    click.echo(f"stepmill {__version__}: proxy on http://{host}:{port}, steps in {db}"
               + (f", {workers} worker processes" if workers > 1 else ""), err=True)
    click.echo(f"mitmproxy CA: {ca}", err=True)
    click.echo(f"trust bundle (system CAs + mitmproxy CA): {bundle}", err=True)
    click.echo(f"write token for the control API: {'$' + ENV if os.environ.get(ENV) else token_path(confdir)}"
               " (never give it to agents)", err=True)
    click.echo(f'agents: eval "$(stepmill env --port {port})"', err=True)
    if workers > 1:
        sys.exit(supervise(args, workers, listeners))
    sys.exit(run(args) or 0)


def _bind_listeners(args: list[str], host: str, port: int, workers: int) -> dict:
    """The TCP listeners the workers share, bound here (once, held by the supervisor): each mode must
    have a fixed TCP port, and a port already taken fails now, before any worker starts."""
    from mitmproxy.proxy import mode_specs

    from stepmill.proxy_master import bind_listener

    specs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--mode", "-m")]
    specs += [a.partition("=")[2] for a in args if a.startswith("--mode=")]
    listeners = {}
    for spec in specs:
        try:
            mode = mode_specs.ProxyMode.parse(spec)
        except ValueError:
            continue  # mitmproxy says what is wrong with it
        if mode.transport_protocol not in ("tcp", "both"):  # both: its UDP side (HTTP/3) in the first worker
            raise click.UsageError(f"--workers {workers}: mode {spec!r} is not TCP; run it with --workers 1")
        listen_host, listen_port = mode.listen_host(host), mode.listen_port(port)
        if not listen_port:
            raise click.UsageError(f"--workers {workers} needs a fixed port for mode {spec!r}, not 0")
        try:
            listeners[f"{listen_host}:{listen_port}"] = bind_listener(listen_host, listen_port)
        except OSError as exc:
            raise click.UsageError(f"port {listen_port} is taken ({exc}): is a proxy already running there?") from None
    return listeners


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
