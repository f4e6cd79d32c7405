"""`stepmill ui` over a fleet: several nodes' files in one Datasette, each page reading the file that holds
its id, and the lifecycle page showing the coordinator's view (nodes, groups by state, lost groups named
with their node) without ever showing the coordinator's password."""

from __future__ import annotations

import json
import signal
from urllib.parse import quote

import pytest

from .browser import UI
from .conftest import wait_until
from .test_fleet import start_node, stop_node, white_box_group


@pytest.mark.timeout(180)
def test_the_ui_browses_several_nodes_and_shows_the_fleet(postgres, upstream, tmp_path, marker):
    from stepmill.store.fleet_ledger import Coordinator

    secret = f"pw-{marker}"
    plain = postgres.new_database()
    url = plain.replace("stepmill@", f"stepmill:{secret}@")  # trust authentication: the password is only shown
    fleet = Coordinator(plain)
    fleet.set_node_timeout(1.5)
    nodes = [start_node(tmp_path, f"node-{x}", plain, upstream=upstream) for x in "uv"]
    try:
        for node in nodes:
            white_box_group(node, f"{node.node_id}-{marker}", [f"{node.node_id}-{marker}-{r}" for r in range(2)])
        wait_until(lambda: fleet.counts()["ready"] == 2, timeout=30, what="both groups ready")
        gone = nodes[0]
        gone.serve.send_signal(signal.SIGKILL)
        gone.serve.wait(10)
        wait_until(lambda: fleet.lost_groups(), timeout=15, what="the lost group")
        with UI([n.proxy.db for n in nodes], env={"STEPMILL_COORDINATOR": url}) as ui:
            status, body, _ = ui.get("/-/stepmill/lifecycle.json")
            assert status == 200, body
            data = json.loads(body)
            assert data["databases"] == ["steps", "steps_2"] and data["database"] == "steps"
            assert data["trajectories"]["total"] == 2  # node-u's file
            fleet_data = data["fleet"]
            assert secret not in body and "***" in fleet_data["coordinator"]
            assert {n["id"]: n["alive"] for n in fleet_data["nodes"]} == {"node-u": False, "node-v": True}
            assert fleet_data["counts"]["lost"] == 1 and fleet_data["counts"]["ready"] == 1
            [lost] = fleet_data["lost"]
            assert (lost["group_id"], lost["node_id"]) == (f"node-u-{marker}", "node-u")
            status, html, _ = ui.get("/-/stepmill/lifecycle?db=steps_2")
            assert status == 200 and secret not in html
            assert "node-u" in html and f"node-u-{marker}" in html and "LOST" in html  # named with its node
            assert json.loads(ui.get("/-/stepmill/lifecycle.json?db=steps_2")[1])["database"] == "steps_2"
            # Pages find the file that holds their id: node-v's trajectory and group from the second file.
            trajectory = f"node-v-{marker}-1"
            status, body, _ = ui.get(f"/-/stepmill/trajectories/{quote(trajectory)}.json")
            assert status == 200 and json.loads(body)["trajectory"]["id"] == trajectory
            status, html, _ = ui.get(f"/-/stepmill/groups/{quote(f'node-v-{marker}')}")
            assert status == 200 and trajectory in html
            step = json.loads(body)["steps"][0]["step_id"]
            status, body, _ = ui.get(f"/-/stepmill/steps/{quote(step)}.json")
            assert status == 200 and json.loads(body)["trajectory_id"] == trajectory
            assert ui.get("/-/stepmill/steps/no-such-step.json")[0] == 404
    finally:
        for node in nodes:
            stop_node(node)
        fleet.close()
