"""The fleet's state from its coordinator: nodes (heartbeats, whether their serve answers now, a lost
proxy), groups by state, lost groups, and what happened on the nodes (restarts, runs run again); and a
fleet on this one machine to try (`stepmill fleet up` / `down`)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from stepmill.cli.options import coordinator_option, json_option

PROBE_S = 2.0  # a node's serve that does not answer its health in this long is shown as not answering
EVENTS_SHOWN = 20


def serve_answers(url: str) -> bool:
    """Whether a node's `stepmill serve` answers its health now (seconds after it died, not the node timeout)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/health", timeout=PROBE_S):
            return True
    except (OSError, ValueError):  # refused, timed out, or an error status (HTTPError is an OSError)
        return False


@click.group(invoke_without_command=True)
@coordinator_option
@click.option("--policy-version", "new_version", help="Set the fleet's policy version first.")
@click.option("--events", "event_count", default=EVENTS_SHOWN, show_default=True,
              help="How many of the latest node events (restarts, runs run again) to show.")
@json_option
@click.pass_context
def fleet(context, coordinator, new_version, event_count, as_json):
    """Nodes (heartbeat, serve answering now, lost), groups by state, the groups a silent node holds (they
    are not handed out), and the latest node events. `stepmill fleet serve ROLLOUT.toml` serves a Ray
    rollout's node files after it."""
    if context.invoked_subcommand is not None:
        return
    from stepmill.store.fleet_ledger import Coordinator

    with Coordinator(coordinator) as board:
        if new_version is not None:
            board.set_policy_version(new_version)
        state = {"coordinator": board.url, "policy_version": board.policy_version(), "nodes": board.nodes(),
                 "groups": board.counts(), "lost": [vars(g) for g in board.lost_groups()],
                 "events": board.node_events(limit=max(1, event_count))}
    with ThreadPoolExecutor(max_workers=8) as pool:  # every node probed at once: the answer in PROBE_S
        answers = list(pool.map(serve_answers, [node["serve_url"] for node in state["nodes"]]))
    for node, answers_now in zip(state["nodes"], answers):
        node["serve_answers"] = answers_now
    if as_json:
        click.echo(json.dumps(state, indent=2, default=str))
        return
    click.echo(f"coordinator: {state['coordinator']}")
    click.echo(f"policy version: {state['policy_version'] or '(none)'}")
    for node in state["nodes"]:
        click.echo(f"node {node['id']}: {'alive' if node['alive'] else 'SILENT'}, last heartbeat "
                   f"{node['silent_s']:.0f} s ago, {node['serve_url']} "
                   f"{'answers' if node['serve_answers'] else 'DOES NOT ANSWER'}"
                   + (f", LOST: {node['lost']}" if node["lost"] else ""))
    click.echo("groups: " + ", ".join(f"{k} {v}" for k, v in state["groups"].items()))
    for lost in state["lost"]:
        click.echo(f"lost: group {lost['group_id']} on node {lost['node_id']}: {lost['reason']}")
    for event in state["events"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["at"]))
        run = f" run {event['run_id']}" if event["run_id"] else ""
        click.echo(f"event {when} node {event['node_id']}: {event['kind'].replace('_', ' ')}{run}: {event['detail']}")


@fleet.command("serve")
@click.argument("config_path", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--until-consumed", is_flag=True,
              help="Stop once no group with runs on these nodes is waiting, ready or leased (default: Ctrl-C).")
@click.option("--node", "nodes", multiple=True, help="Only this node's file (repeatable; default: every node file).")
@click.option("--node-dir", help="The nodes' files, without CONFIG_PATH (default: its [run] node_dir).")
@click.option("--confdir", help="mitmproxy's directory, without CONFIG_PATH (default: its [proxy] confdir, "
                                "else ~/.mitmproxy).")
@click.option("--stop", is_flag=True, help='Stop what serves these node files after a rollout ([run] serve = "keep"),'
                                           " and exit.")
@coordinator_option
def serve_nodes(config_path, until_consumed, nodes, node_dir, confdir, stop, coordinator):
    """Serve again, for trainers, every node file of the Ray rollout's [run] node_dir on this machine: each as
    the node the coordinator knows (its id, its serve URL), restarted where it dies."""
    from stepmill.cli.options import stop_on_signals
    from stepmill.errors import ConfigError
    from stepmill.fleet.keep_serving import keep_serving, stop_kept
    from stepmill.store.fleet_ledger import Coordinator

    coordinator, node_dir, confdir = _serve_settings(config_path, coordinator, node_dir, confdir)
    if stop:
        stopped = stop_kept(node_dir, list(nodes))
        click.echo(f"stepmill fleet serve: stopped the serving of {', '.join(stopped) or 'no node'}", err=True)
        return
    if not coordinator:
        raise ConfigError("stepmill fleet serve serves a Ray rollout's node files as the coordinator knows them: "
                          "it needs a coordinator ([run] coordinator, --coordinator or STEPMILL_COORDINATOR)")
    stop_on_signals()
    with Coordinator(coordinator) as board:
        served = keep_serving(board, coordinator, node_dir, confdir, until_consumed=until_consumed, only=list(nodes),
                              say=lambda line: click.echo(line, err=True))
    if not served:
        raise ConfigError(f"no node file of the coordinator's nodes in {node_dir}")


def _serve_settings(config_path, coordinator, node_dir, confdir) -> tuple[str | None, str, str]:
    """The coordinator, node folder and confdir `fleet serve` uses: from the options, else the rollout's."""
    from stepmill.errors import ConfigError
    from stepmill.runner.config import load

    if config_path is None:
        if not node_dir:
            raise ConfigError("stepmill fleet serve: name the Ray rollout's configuration, or --node-dir")
        return coordinator, node_dir, os.path.expanduser(confdir or "~/.mitmproxy")
    config = load(config_path)
    if config.run.executor != "ray":
        raise ConfigError(f'{config_path}: stepmill fleet serve serves a Ray rollout\'s node files: executor = "ray"')
    return (config.run.coordinator or coordinator, node_dir or config.run.node_dir,
            os.path.expanduser(confdir or config.proxy.get("confdir", "~/.mitmproxy")))


COMMANDS = [fleet]


FLEET_TOML = "fleet.toml"


def _run_lines(address: str, coordinator: str, node_dir: Path) -> str:
    """What `fleet up` writes to DIR/fleet.toml: the [run] keys of a rollout on what it started."""
    return (f"# From `stepmill fleet up`: the last lines of your rollout.toml's [run] table\n"
            f'executor = "ray"\nray_address = "{address}"\ncoordinator = "{coordinator}"\nnode_dir = "{node_dir}"\n')


def _say_coordinator(server, was_running: bool) -> str:
    from stepmill.fleet.local_coordinator import DATABASE

    url = server.url(DATABASE)
    state = "running already" if was_running else "started"
    click.echo(f"coordinator: {url} ({state}: PostgreSQL on 127.0.0.1:{server.port}, role {DATABASE} with trust "
               f"authentication for any local user; data {server.data}, log {server.log})")
    return url


def _say_ray(state: dict, reused: bool) -> dict:
    head = state["nodes"][0]
    click.echo(f"ray: {state['address']} ({'running already' if reused else 'started'}: {state['alive']} nodes "
               f"alive; GCS port {head['gcs']}, dashboard port {head['dashboard']} (no dashboard UI), no client "
               f"server (ray:// needs ray[client]); logs {state['temp_dir']}/session_latest/logs)")
    for number, ports in enumerate(state["nodes"], start=1):
        named = ", ".join(f"{name.replace('_', ' ')} {port}" for name, port in ports.items()
                          if name not in ("gcs", "dashboard"))
        click.echo(f"ray node {number}{' (head)' if number == 1 else ''}: ports {named}; workers on ports the OS picks")
    return state


def _has_ray() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


@fleet.command("up")
@click.option("--dir", "fleet_dir", default="~/.stepmill/fleet", show_default=True,
              help="The folder of the coordinator's data, Ray's files, the nodes' files and fleet.toml.")
@click.option("--nodes", default=2, show_default=True, type=click.IntRange(min=1), help="Ray nodes on this machine.")
@click.option("--cpus-per-node", type=click.IntRange(min=1), help="CPUs each Ray node offers (default: the "
              "machine's cores shared out, at least 1).")
@click.option("--pg-port", type=click.IntRange(1, 65535), help="The coordinator's port when it starts "
              "(default: the one it had, else a free one).")
def fleet_up(fleet_dir, nodes, cpus_per_node, pg_port):
    """A fleet on this machine to try: a local PostgreSQL coordinator and a local Ray cluster of --nodes
    nodes, started unless they run; writes DIR/fleet.toml, the [run] lines of a rollout on them."""
    from stepmill.fleet.local_coordinator import coordinator_up, missing_reason
    from stepmill.fleet.local_ray import ray_up

    missing = missing_reason() or (None if _has_ray() else "Ray is not installed (pip install 'stepmill[fleet]')")
    if missing:
        raise click.ClickException(f"stepmill fleet up: {missing}")
    folder = Path(fleet_dir).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cpus = cpus_per_node or max(1, (os.cpu_count() or 1) // nodes)
    try:
        coordinator = _say_coordinator(*coordinator_up(folder, pg_port))
        state = _say_ray(*ray_up(folder, nodes, cpus))
    except RuntimeError as exc:  # initdb, pg_ctl or ray start failed: what it said, and its log
        raise click.ClickException(str(exc)) from None
    node_dir = folder / "nodes"
    (folder / FLEET_TOML).write_text(_run_lines(state["address"], coordinator, node_dir))
    click.echo(f"nodes' files: {node_dir} (each node's steps node-….db and serve log node-….serve.log; each "
               "proxy's log $TMPDIR/stepmill-rollout-proxy-PORT.log)")
    click.echo("write token: the stepmill-token file in your rollout's [proxy] confdir (default ~/.mitmproxy), "
               "made by the rollout before its first run; trainers and `stepmill fleet serve` read it there")
    click.echo(f"wrote {folder / FLEET_TOML}; with [run] last in rollout.toml: "
               f"cat {folder / FLEET_TOML} >> rollout.toml")
    click.echo(f"export STEPMILL_COORDINATOR={coordinator}")


@fleet.command("down")
@click.option("--dir", "fleet_dir", default="~/.stepmill/fleet", show_default=True, help="The folder `up` used.")
def fleet_down(fleet_dir):
    """Stop what `stepmill fleet up --dir DIR` started: what still serves its nodes' files after a rollout,
    its Ray cluster's processes (no other Ray on the machine) and its PostgreSQL (cleanly; its data stays
    for the next `up`)."""
    from stepmill.fleet.keep_serving import stop_kept
    from stepmill.fleet.local_coordinator import coordinator_down
    from stepmill.fleet.local_ray import ray_down, temp_folder

    folder = Path(fleet_dir).expanduser().resolve()
    if not folder.is_dir():
        raise click.ClickException(f"stepmill fleet down: {folder} is not a folder `stepmill fleet up` made")
    kept = stop_kept(str(folder / "nodes"))
    if kept:
        click.echo(f"kept serving: stopped for {', '.join(kept)}")
    stopped = ray_down(folder)
    click.echo(f"ray: {stopped} processes of the cluster in {temp_folder(folder)} stopped")
    click.echo(f"coordinator: {'stopped' if coordinator_down(folder) else 'was not running'} "
               f"(its data stays in {(folder / 'postgres').resolve()})")
