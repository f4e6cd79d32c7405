"""Nodes that heal: a Ray node's proxy killed with SIGKILL in the middle of a rollout is restarted by its
node (same ports, same file), the runs it cut run again in the same rollout, and every group is trained
on exactly once; `stepmill fleet` shows the restart and the reruns.

A local two-node Ray cluster, a real PostgreSQL coordinator, the shipped tool-loop agent against the
simulated LLM. Each run sleeps after its calls, so that when the first group of a node has finished its
second group is in flight: that is when the node's proxy is killed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter

import pytest
from stepmill.store import Store

from .conftest import STEPMILL, wait_until
from .fleet_processes import acks_by_group, events, start_consumer, start_serve
from .test_ray_rollout import _config, _files, _left_behind, _trajectories

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stepmill[fleet]'")
pytestmark = pytest.mark.slow

RUNS = 8  # 4 tasks, n = 2: two groups on each node, two runs at once on each


def _agent(marker: str) -> list[str]:
    """The tool loop, then 5 s asleep (the run in flight): its calls are made before its node may die."""
    return ["{python}", "-c", "import runpy, sys, time; sys.argv = ['tool_loop', '--model', '{model}']\n"
            "try:\n    runpy.run_module('stepmill.agents.tool_loop', run_name='__main__')\n"
            f"finally:\n    time.sleep(5)  # {marker}"]


def _proxy_pid(port: str) -> int:
    found = [line for line in _left_behind(f"--port {port}") if "stepmill.cli proxy" in line]
    assert len(found) == 1, found
    return int(found[0].split(":")[0])


def _complete(path: str, marker: str) -> int:
    return sum(row["status"] == "complete" for row in _trajectories(path, marker).values())


def _first_group_done_second_in_flight(path: str, marker: str) -> bool:
    """Two runs complete, and a third whose calls are in the file (it sleeps 5 s before it ends)."""
    if _complete(path, marker) < 2:
        return False
    store = Store(path, readonly=True)
    try:
        called = store.query("SELECT count(DISTINCT trajectory_id) AS n FROM steps WHERE trajectory_id LIKE ?",
                             [f"ray-{marker}-%"])
        return called[0]["n"] >= 3
    finally:
        store.close()


def _gated_rows(files: dict[str, str]) -> tuple[int, Counter]:
    """Gated steps with token ids over the nodes' files, and gated steps per (node, trajectory)."""
    with_ids, per_run = 0, Counter()
    for name, path in files.items():
        store = Store(path, readonly=True)
        for step in store.iter_steps(gate=True):
            with_ids += step["response_ids"] is not None
            per_run[name, step["trajectory_id"]] += 1
        store.close()
    return with_ids, per_run


def _latest_attempt(path: str, run: str) -> tuple[set, set]:
    """(the run's steps the gate keeps, its steps started since its latest registration)."""
    store = Store(path, readonly=True)
    try:
        since = store.registered_at(run)
        kept = {step["step_id"] for step in store.iter_steps(gate=True, trajectory_id=run, with_tokens=False)}
        latest = {row["id"] for row in store.query("SELECT id FROM steps WHERE trajectory_id = ? AND started_at >= ?",
                                                   [run, since])}
        return kept, latest
    finally:
        store.close()


def _hold_port(port: int, timeout: float = 10.0) -> socket.socket:
    """A listening socket on the port a killed proxy had: its restarts cannot bind there. It closes every
    connection at once, as a port nobody serves would refuse it (a run's last call fails, it does not hang)."""
    deadline = time.monotonic() + timeout
    while True:
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            break
        except OSError:
            holder.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)

    def refuse():
        while True:
            try:
                holder.accept()[0].close()
            except OSError:  # the holder closed: the test is over
                return

    threading.Thread(target=refuse, daemon=True).start()
    return holder


def _start_rollout(tmp_path, llm_url: str, marker: str, url: str, ray_cluster):
    """The rollout of 8 runs started: (its configuration, its log, its process)."""
    config = _config(tmp_path, llm_url, marker, url, ray_cluster, command=_agent(marker))
    log = tmp_path / "rollout.log"
    with log.open("wb") as out:  # a file, not a pipe: nothing the runner prints can block it
        return config, log, subprocess.Popen(STEPMILL + ["rollout", str(config), "--no-progress"], stderr=out)


def _kill_a_proxy_mid_rollout(rollout, log, marker: str) -> tuple[str, str, str, int]:
    """Once a node's first group is done and its second in flight, its proxy killed with SIGKILL:
    (node, its proxy's port, its file, the pid killed)."""
    wait_until(lambda: rollout.poll() is not None or len(re.findall(r": proxy http://", log.read_text())) == 2,
               timeout=300, interval=0.5, what="both nodes up")
    node, port, db = re.findall(r"stepmill: (node-\S+): proxy http://127\.0\.0\.1:(\d+), serve \S+, steps in (\S+)",
                                log.read_text())[0]
    wait_until(lambda: rollout.poll() is not None or _first_group_done_second_in_flight(db, marker),
               timeout=300, interval=0.2, what=f"a group finished on {node}, the next in flight")
    assert rollout.poll() is None, log.read_text()
    assert _complete(db, marker) < 4, "the node's runs were all done before its proxy could be killed"
    doomed = _proxy_pid(port)
    os.kill(doomed, signal.SIGKILL)
    return node, port, db, doomed


@pytest.mark.timeout(900)
def test_a_killed_node_proxy_is_restarted_and_its_runs_run_again(ray_cluster, url, simulated_llm, marker,
                                                                 tmp_path):
    from stepmill.store.fleet_ledger import Coordinator

    config, log, rollout = _start_rollout(tmp_path, simulated_llm.url, marker, url, ray_cluster)
    try:
        node, _, _, _ = _kill_a_proxy_mid_rollout(rollout, log, marker)
        assert rollout.wait(timeout=600) == 0, log.read_text()
    finally:
        if rollout.poll() is None:
            rollout.kill()
    stderr = log.read_text()
    assert f"{RUNS} runs finished (0 failed, 0 timed out), 0 done earlier, of {RUNS}" in stderr, stderr
    assert f"node {node}: proxy died: exit -9" in stderr and f"node {node}: proxy restarted" in stderr, stderr
    reruns = set(re.findall(rf"run (ray-{marker}-\S+) on {re.escape(node)} was cut \(.*\); it runs again", stderr))
    assert reruns, stderr
    assert not _left_behind(str(tmp_path / "nodes")), "a node's proxy or serve outlived the rollout"

    files = _files(tmp_path)
    assert sorted(t for path in files.values() for t, row in _trajectories(path, marker).items()
                  if row["status"] == "complete") == sorted(f"ray-{marker}-t0{i}-{k}" for i in range(1, 5) for k in range(2))
    shown = subprocess.run(STEPMILL + ["fleet", "--coordinator", url], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"node {node}: proxy died" in shown.stdout and f"node {node}: proxy restarted" in shown.stdout, shown.stdout
    assert {run for run in reruns if f"node {node}: rerun run {run}: retry 1 of 2" in shown.stdout} == reruns, \
        shown.stdout
    assert "LOST" not in shown.stdout and "DOES NOT ANSWER" in shown.stdout  # the rollout's serves stopped with it

    # Trainers consume every group: once each, every row once. A rerun's cut attempt is out of the gate:
    # what the gate keeps of a rerun is exactly the calls of its latest attempt. (Not "as many as its group
    # mate": the simulated LLM flips the k-th coin for the k-th asking of a prompt, so a rerun may answer
    # in one call where its mate used a tool.)
    # The nodes' files are served again by `stepmill fleet serve` (ids and URLs from the coordinator),
    # which stops by itself once every group is consumed.
    token = (tmp_path / "mitm" / "stepmill-token").read_text().strip()
    serving_log = tmp_path / "fleet-serve.log"
    serving = subprocess.Popen(STEPMILL + ["fleet", "serve", str(config), "--until-consumed"],
                               stderr=serving_log.open("wb"))
    try:
        wait_until(lambda: serving.poll() is not None or serving_log.read_text().count(" at http://") == 2,
                   timeout=120, interval=0.5, what="stepmill fleet serve serving both nodes")
        assert serving.poll() is None, serving_log.read_text()
        assert set(re.findall(r"node (\S+) at http://", serving_log.read_text())) == set(files)
        groups = {row["group_id"] for path in files.values() for row in _trajectories(path, marker).values()}
        out = tmp_path / "consumers.jsonl"
        trainer = start_consumer(url, "trainer", {name: token for name in files}, out, lease=30, expect=len(groups))
        assert trainer.wait(300) == 0, (tmp_path / "trainer.err").read_text()
        assert serving.wait(60) == 0 and "is consumed" in serving_log.read_text(), serving_log.read_text()
    finally:
        if serving.poll() is None:
            serving.kill()
    acked = [e for e in events(out) if e["event"] == "acked"]
    assert Counter(e["group"] for e in acked) == Counter(groups)
    with Coordinator(url) as fleet:
        assert acks_by_group(fleet, groups) == Counter(groups)
    with_ids, per_run = _gated_rows(files)
    assert sum(e["rows"] for e in acked) == with_ids > 0
    for run in reruns:
        kept, latest = _latest_attempt(files[node], run)
        assert per_run[node, run] == len(latest) > 0 and kept == latest, (run, kept, latest)
    assert not _left_behind(str(tmp_path / "nodes")), "stepmill fleet serve left a serve running"


@pytest.mark.timeout(900)
def test_a_node_whose_proxy_cannot_come_back_is_lost_and_its_groups_move(ray_cluster, url, simulated_llm, marker,
                                                                         tmp_path):
    from stepmill.store.fleet_ledger import Coordinator

    _, log, rollout = _start_rollout(tmp_path, simulated_llm.url, marker, url, ray_cluster)
    holder = None
    try:
        node, port, db, _ = _kill_a_proxy_mid_rollout(rollout, log, marker)
        holder = _hold_port(int(port))  # every restart of the proxy fails to listen
        assert rollout.wait(timeout=600) == 0, log.read_text()
    finally:
        if rollout.poll() is None:
            rollout.kill()
        if holder is not None:
            holder.shutdown(socket.SHUT_RDWR)  # wakes its accept: the port is free again
            holder.close()
    stderr = log.read_text()
    assert f"{RUNS} runs finished (0 failed, 0 timed out), 0 done earlier, of {RUNS}" in stderr, stderr
    assert f"node {node}: proxy lost: its proxy died and did not come back after 3 starts" in stderr, stderr
    moved = re.findall(rf"group (\S+) moves from {re.escape(node)} to (\S+)", stderr)
    assert moved and all(target != node for _, target in moved), stderr

    files = _files(tmp_path)
    with Coordinator(url) as fleet:
        lost = {n["id"]: n["lost"] for n in fleet.nodes()}
        assert lost[node] and "did not come back" in lost[node]
        for group, target in moved:  # the coordinator places the group's runs where they ran again
            runs = fleet.group(group)["runs"]
            assert {run["node_id"] for run in runs.values()} == {target} and fleet.group(group)["ready"]
            there = _trajectories(files[target], marker)
            assert all(there[run]["status"] == "complete" for run in runs)
        assert fleet.counts()["ready"] == 4
    shown = subprocess.run(STEPMILL + ["fleet", "--coordinator", url], capture_output=True, text=True, timeout=60)
    assert "LOST: its proxy died" in shown.stdout and "proxy lost" in shown.stdout, shown.stdout
    assert all(f"moved: group {group} (2 runs) moved here" in shown.stdout for group, _ in moved), shown.stdout

    # Trainers consume every group once, each from the node the coordinator names; the moved groups'
    # first attempts in the lost node's file are set aside: no reader of that file trains on them.
    token = (tmp_path / "mitm" / "stepmill-token").read_text().strip()
    serves = [start_serve(name, path, tmp_path / "mitm", url, tmp_path)[0] for name, path in files.items()]
    try:
        out = tmp_path / "consumers.jsonl"
        trainer = start_consumer(url, "trainer", {name: token for name in files}, out, lease=30, expect=4)
        assert trainer.wait(300) == 0, (tmp_path / "trainer.err").read_text()
        acked = [e for e in events(out) if e["event"] == "acked"]
        assert sorted(Counter(e["group"] for e in acked).values()) == [1, 1, 1, 1]
        with_ids, per_run = _gated_rows(files)
        assert sum(e["rows"] for e in acked) == with_ids > 0
        left_on_lost = [run for run, row in _trajectories(db, marker).items() if row["group_id"] in dict(moved)]
        assert left_on_lost and not any((node, run) in per_run for run in left_on_lost), per_run
    finally:
        for serve in serves:
            serve.send_signal(signal.SIGTERM)
            serve.wait(10)


def test_node_events_a_lost_node_and_a_group_that_moves(fleet):
    from stepmill.errors import BadInput, Conflict

    fleet.register_node("node-a", "http://127.0.0.1:1")
    fleet.register_node("node-b", "http://127.0.0.1:2")
    for group in ("g1", "g2"):
        fleet.register_group(group, 2)
        for k in range(2):
            fleet.register_run(f"{group}-{k}", group_id=group, node_id="node-a")
    for k in range(2):  # g2 is ready on node-a: its steps were handed out as they are, it never moves
        fleet.report(f"g2-{k}", finished=True, committed=True, scored=True)
    fleet.report("g1-0", finished=True, committed=True, scored=True)

    fleet.node_event("node-a", "proxy_died", "exit -9")
    fleet.node_event("node-a", "rerun", "retry 1 of 2", run_id="g1-1")
    fleet.node_event("node-a", "proxy_lost", "no answer after 3 starts")
    assert {n["id"]: n["lost"] for n in fleet.nodes()} == {"node-a": "no answer after 3 starts", "node-b": None}
    assert fleet.move_group("g1", "node-b", "node-a was lost") == ["g1-0", "g1-1"]
    moved = fleet.group("g1")
    assert not moved["ready"] and {run["node_id"] for run in moved["runs"].values()} == {"node-b"}
    assert not any(run["finished"] or run["scored"] for run in moved["runs"].values())  # it runs there afresh
    with pytest.raises(Conflict, match="ready"):
        fleet.move_group("g2", "node-b", "node-a was lost")
    assert [(e["node_id"], e["kind"], e["run_id"]) for e in fleet.node_events()] == [
        ("node-a", "proxy_died", None), ("node-a", "rerun", "g1-1"), ("node-a", "proxy_lost", None),
        ("node-b", "moved", None)]
    assert "group g1 (2 runs) moved here: node-a was lost" in fleet.node_events("node-b")[0]["detail"]
    with pytest.raises(BadInput, match="node event"):
        fleet.node_event("node-a", "exploded")
    fleet.register_node("node-a", "http://127.0.0.1:3")  # the node back: it takes runs again
    assert {n["id"]: n["lost"] for n in fleet.nodes()}["node-a"] is None
