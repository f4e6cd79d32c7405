"""The fleet's state from its coordinator: nodes (heartbeats, whether their serve answers now, a lost
proxy), groups by state, lost groups, and what happened on the nodes (restarts, runs run again)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

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
@click.argument("config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--until-consumed", is_flag=True,
              help="Stop once no group with runs on these nodes is waiting, ready or leased (default: Ctrl-C).")
def serve_nodes(config_path, until_consumed):
    """Serve again, for trainers, every node file of the Ray rollout's [run] node_dir on this machine: each as
    the node the coordinator knows (its id, its serve URL), restarted where it dies."""
    from stepmill.cli.options import stop_on_signals
    from stepmill.errors import ConfigError
    from stepmill.fleet.keep_serving import keep_serving
    from stepmill.runner.config import load
    from stepmill.store.fleet_ledger import ENV, Coordinator

    config = load(config_path)
    coordinator = config.run.coordinator or os.environ.get(ENV)
    if config.run.executor != "ray" or not coordinator:
        raise ConfigError(f"{config_path}: stepmill fleet serve serves a Ray rollout's node files: it needs "
                          'executor = "ray" and a coordinator ([run] coordinator or STEPMILL_COORDINATOR)')
    confdir = os.path.expanduser(config.proxy.get("confdir", "~/.mitmproxy"))
    stop_on_signals()
    with Coordinator(coordinator) as board:
        served = keep_serving(board, coordinator, config.run.node_dir, confdir, until_consumed=until_consumed,
                              say=lambda line: click.echo(line, err=True))
    if not served:
        raise ConfigError(f"no node file of the coordinator's nodes in {config.run.node_dir}")


COMMANDS = [fleet]
