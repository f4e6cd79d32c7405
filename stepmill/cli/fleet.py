"""The fleet's state from its coordinator: nodes and their heartbeats, groups by state, lost groups."""

from __future__ import annotations

import json

import click

from stepmill.cli.options import coordinator_option, json_option


@click.command()
@coordinator_option
@click.option("--policy-version", "new_version", help="Set the fleet's policy version first.")
@json_option
def fleet(coordinator, new_version, as_json):
    """Nodes, groups by state, and the groups a silent node holds (they are not handed out)."""
    from stepmill.store.fleet_ledger import Coordinator

    with Coordinator(coordinator) as board:
        if new_version is not None:
            board.set_policy_version(new_version)
        state = {"coordinator": board.url, "policy_version": board.policy_version(), "nodes": board.nodes(),
                 "groups": board.counts(), "lost": [vars(g) for g in board.lost_groups()]}
    if as_json:
        click.echo(json.dumps(state, indent=2, default=str))
        return
    click.echo(f"coordinator: {state['coordinator']}")
    click.echo(f"policy version: {state['policy_version'] or '(none)'}")
    for node in state["nodes"]:
        click.echo(f"node {node['id']}: {'alive' if node['alive'] else 'SILENT'}, last heartbeat "
                   f"{node['silent_s']:.0f} s ago, {node['serve_url']}")
    click.echo("groups: " + ", ".join(f"{k} {v}" for k, v in state["groups"].items()))
    for lost in state["lost"]:
        click.echo(f"lost: group {lost['group_id']} on node {lost['node_id']}: {lost['reason']}")


COMMANDS = [fleet]
