"""A fleet on one machine: nodes (a real `stepmill proxy` and `stepmill serve --node-id`, each with its own
SQLite file), a real PostgreSQL coordinator, and trainers (`RemoteConsumer` processes) that claim groups
there and fetch their steps from the nodes. The faults are real: a consumer killed with SIGKILL while it
holds a claim, a proxy killed mid-stream, PostgreSQL restarted under consumers, a node that never comes
back, two runners (`stepmill rollout`) sharing one coordinator.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest


from .conftest import STEPMILL, Proxy, launch_proxy, start_proxy, stop_proxy, wait_until
from .fleet_processes import acks_by_group, events, start_consumer, start_serve





@dataclass
class Node:
    node_id: str
    proxy: Proxy
    serve: subprocess.Popen
    serve_url: str
    tmp: Path

    def gated_rows(self, groups: set[str]) -> int:
        """Steps of these groups the gate lets through, with token ids: what a trainer should get from here."""
        store = self.proxy.store()
        try:
            return sum(1 for s in store.iter_steps(gate=True) if s["group_id"] in groups
                       and s["prompt_ids"] is not None and s["response_ids"] is not None)
        finally:
            store.close()


def start_node(tmp: Path, node_id: str, url: str, *, upstream=None, llm=None) -> Node:
    tmp = tmp / node_id
    if upstream is not None:
        proxy = start_proxy(tmp, upstream)
    else:
        proxy = launch_proxy(tmp, llm.url.removesuffix("/v1"), "--set", "termlog_verbosity=warn")
    serve, serve_url = start_serve(node_id, proxy.db, proxy.confdir, url, tmp)
    return Node(node_id, proxy, serve, serve_url, tmp)


def stop_node(node: Node) -> None:
    if node.serve.poll() is None:
        node.serve.terminate()
        node.serve.wait(10)
    if node.proxy.process.poll() is None:
        stop_proxy(node.proxy)


def white_box_group(node: Node, group: str, runs: list[str], *, steps: int = 2) -> None:
    """Runs as a runner makes them: every run registered with the node's proxy before any starts, then
    each one's steps submitted with token ids, then each completed with a reward."""
    client = node.proxy.client()
    for run in runs:
        client.start_trajectory(trajectory_id=run, group_id=group, channel="train")
        client.register_run(run)
    for k, run in enumerate(runs):
        for i in range(steps):
            client.submit_step(trajectory_id=run, prompt_ids=[1, 2, 3, i], response_ids=[4, 5, 6][:2 + i % 2],
                               logprobs=[-0.1, -0.2, -0.3][:2 + i % 2])
        client.complete_trajectory(run, reward=float(k))


def rollout_config(tmp: Path, node: Node, llm, dataset: str, tasks: int) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tasks.jsonl").write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"What is {i} + {i}?",
                                                           "answer": str(2 * i)}) for i in range(tasks)) + "\n")
    config = tmp / "rollout.toml"
    command = [sys.executable, "-m", "stepmill.agents.tool_loop", "--model", "{model}"]
    config.write_text(f"""
[proxy]
url = "{node.proxy.url}"
db = "{node.proxy.db}"
confdir = "{node.proxy.confdir}"

[route]
base_url = "{llm.url}"

[[agent]]
name = "tool-loop"
command = {json.dumps(command)}
env = {{ OPENAI_API_KEY = "sk-local" }}

[[dataset]]
name = "{dataset}"
path = "tasks.jsonl"

[run]
agent = "tool-loop"
dataset = "{dataset}"
n = 2
concurrency = 4
timeout = 120
model = "qwen-sim"

[[reward]]
name = "math"
function = "stepmill.rewards.functions:math_answer"
""")
    return config


@pytest.mark.timeout(300)
def test_a_fleet_of_nodes_is_consumed_exactly_once(fleet, url, simulated_llm, tmp_path, marker):
    """2 nodes × (a `stepmill rollout` of 2 groups each, both runners at once on one coordinator, + 3
    client-made groups each) + a group spread over both; 3 trainers, one killed holding a claim: every
    group acknowledged exactly once, the rows fetched equal the nodes' gated steps."""
    nodes = [start_node(tmp_path, f"node-{x}", url, llm=simulated_llm) for x in "ab"]
    try:
        # The group a runner spreads over two nodes: it registers the group's full size itself.
        spread = f"spread-{marker}"
        fleet.register_group(spread, 2)
        runners = [subprocess.Popen(STEPMILL + ["rollout", str(rollout_config(tmp_path / f"r-{n.node_id}", n,
                                                                               simulated_llm, f"ds{i}-{marker}", 2)),
                                                "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
                   for i, n in enumerate(nodes)]
        groups = {f"ds{i}-{marker}-t{t}" for i in range(2) for t in range(2)} | {spread}
        for node in nodes:
            for g in range(3):
                group = f"{node.node_id}-{marker}-g{g}"
                groups.add(group)
                white_box_group(node, group, [f"{group}-{r}" for r in range(2)])
            white_box_group(node, spread, [f"{spread}-{node.node_id}"])
        for runner in runners:
            assert runner.wait(240) == 0, runner.stderr.read()
        wait_until(lambda: fleet.counts()["ready"] == len(groups), timeout=60, what="every group ready")
        assert fleet.counts()["waiting"] == 0
        tokens = {n.node_id: n.proxy.token for n in nodes}

        out = tmp_path / "consumers.jsonl"
        doomed = start_consumer(url, "doomed", tokens, out, lease=2, die=True)
        wait_until(lambda: any(e["event"] == "claimed" for e in events(out)), timeout=60, what="a claim")
        doomed.send_signal(signal.SIGKILL)  # holding its claim, never acknowledged
        doomed.wait(10)
        [held] = [e["group"] for e in events(out) if e["consumer"] == "doomed"]
        trainers = [start_consumer(url, f"trainer-{k}", tokens, out, hold=0.1, lease=2, expect=len(groups))
                    for k in range(2)]
        for trainer in trainers:
            assert trainer.wait(120) == 0, (tmp_path / "trainer-0.err").read_text()

        acked = [e for e in events(out) if e["event"] == "acked"]
        assert Counter(e["group"] for e in acked) == Counter(groups)  # each once, by the trainers' word
        assert acks_by_group(fleet, groups) == Counter(groups)  # and by the coordinator's history
        assert not [e for e in events(out) if e["event"] == "conflict"]
        history = fleet.history(held)
        assert history[0]["consumer"] == "doomed" and history[0]["ended"] == "expired"
        assert history[-1]["ended"] == "acked" and history[-1]["consumer"].startswith("trainer-")
        [spread_claim] = [e for e in events(out) if e["event"] == "claimed" and e["group"] == spread
                          and e["consumer"] != "doomed"]
        assert spread_claim["nodes"] == ["node-a", "node-b"]  # fetched from both nodes, joined
        assert spread_claim["trajectories"] == [f"{spread}-node-a", f"{spread}-node-b"]
        fetched = sum(e["rows"] for e in acked)
        assert fetched == sum(n.gated_rows(groups) for n in nodes) > 0
        assert fleet.counts() == {"waiting": 0, "ready": 0, "leased": 0, "acked": len(groups), "stale": 0, "lost": 0}
    finally:
        for node in nodes:
            stop_node(node)


@pytest.mark.timeout(180)
def test_a_proxy_killed_mid_stream_keeps_its_finished_calls_and_the_group_waits(fleet, url, upstream, tmp_path,
                                                                                 marker):
    import openai

    from stepmill.tags import tag_path
    from stepmill.fleet.remote_consumer import RemoteConsumer

    node = start_node(tmp_path, "node-k", url, upstream=upstream)
    try:
        group, run = f"g-{marker}", f"run-{marker}"
        fleet.register_group(group, 1)  # the runner's registration: the group waits for this run
        fleet.register_run(run, group_id=group, node_id="node-k")
        client = node.proxy.client()
        client.start_trajectory(trajectory_id=run, group_id=group, channel="train")
        secret = client.register_run(run)["secret"]
        agent = openai.OpenAI(api_key="sk-x", max_retries=0, timeout=30,
                              base_url=f"http://127.0.0.1:{node.proxy.reverse_port}{tag_path(run, secret=secret)}/v1")
        agent.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"first {marker}"}])
        node.proxy.steps("s.trajectory_id = ?", [run], count=1)
        started = threading.Event()

        def stream():
            try:
                for _ in agent.chat.completions.create(model=f"gated-stream-{marker}", stream=True,
                                                       messages=[{"role": "user", "content": f"second {marker}"}]):
                    started.set()
            except Exception:
                pass  # cut by the kill

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert started.wait(15), "the stream's first event"
        node.proxy.process.send_signal(signal.SIGKILL)
        node.proxy.process.wait(10)
        streaming.join(30)
        upstream.release(f"gated-stream-{marker}")

        trainer = RemoteConsumer(url, "trainer", tokens={"node-k": node.proxy.token}, lease_seconds=5)
        time.sleep(1.0)  # a few heartbeats of the node: nothing to publish, the run is not complete
        assert fleet.counts()["waiting"] == 1 and trainer.claim() is None  # not handed out incomplete

        node.proxy = start_proxy(node.tmp, upstream)  # the same file: the journal is replayed
        texts = [m["content"] for s in node.proxy.steps("s.trajectory_id = ?", [run], count=1)
                 for m in s["messages"]]
        assert f"first {marker}" in texts  # the finished call is kept
        assert fleet.counts()["waiting"] == 1 and trainer.claim() is None
        node.proxy.client().submit_step(trajectory_id=run, prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5])
        node.proxy.client().complete_trajectory(run, reward=1.0)  # the run finishes on the restarted proxy
        batch = wait_until(trainer.claim, timeout=30, what="the group, ready once its run is complete")
        assert batch.meta["group_id"] == group and batch.meta["nodes"] == ["node-k"]
        assert len(batch) == node.gated_rows({group}) >= 1
        trainer.ack(batch)
        assert fleet.counts()["acked"] == 1
    finally:
        stop_node(node)


@pytest.mark.timeout(240)
def test_postgresql_restarted_during_claims_hands_out_no_group_twice_and_loses_none(fleet, url, postgres, upstream,
                                                                                     tmp_path, marker):
    node = start_node(tmp_path, "node-p", url, upstream=upstream)
    try:
        groups = [f"p-{marker}-{g}" for g in range(16)]
        for group in groups:
            white_box_group(node, group, [f"{group}-{r}" for r in range(2)], steps=1)
        wait_until(lambda: fleet.counts()["ready"] == len(groups), timeout=60, what="every group ready")
        out = tmp_path / "consumers.jsonl"
        tokens = {"node-p": node.proxy.token}
        trainers = [start_consumer(url, f"trainer-{k}", tokens, out, hold=0.3, lease=6, expect=len(groups))
                    for k in range(2)]
        wait_until(lambda: len([e for e in events(out) if e["event"] == "acked"]) >= 3, timeout=60,
                   what="the first acknowledgements")
        postgres.restart("immediate")  # every connection drops, mid-transaction for some
        wait_until(lambda: len([e for e in events(out) if e["event"] == "acked"]) >= 9, timeout=60,
                   what="acknowledgements after the restart")
        postgres.restart("fast")
        for trainer in trainers:
            assert trainer.wait(150) == 0, (tmp_path / "trainer-0.err").read_text()
        acked = [e for e in events(out) if e["event"] == "acked"]
        claimed = [e for e in events(out) if e["event"] == "claimed"]
        assert Counter(e["group"] for e in acked) == Counter(groups)
        assert Counter(e["group"] for e in claimed) == Counter(groups)  # no batch reached two trainers
        assert not [e for e in events(out) if e["event"] == "conflict"]
        assert acks_by_group(fleet, groups) == Counter(groups)
        assert sum(e["rows"] for e in acked) == node.gated_rows(set(groups)) == 2 * len(groups)
    finally:
        stop_node(node)


@pytest.mark.timeout(120)
def test_a_node_that_never_comes_back_has_its_groups_reported(fleet, url, upstream, tmp_path, marker):
    from stepmill.store.fleet_ledger import Coordinator
    from stepmill.fleet.remote_consumer import RemoteConsumer

    fleet.set_node_timeout(1.5)  # for every process that opens the coordinator from now
    nodes = [start_node(tmp_path, f"node-{x}", url, upstream=upstream) for x in "lm"]
    try:
        for node in nodes:
            white_box_group(node, f"{node.node_id}-{marker}", [f"{node.node_id}-{marker}-0"])
        wait_until(lambda: fleet.counts()["ready"] == 2, timeout=30, what="both groups ready")
        gone = nodes[0]
        gone.serve.send_signal(signal.SIGKILL)
        gone.proxy.process.send_signal(signal.SIGKILL)
        gone.serve.wait(10)
        gone.proxy.process.wait(10)
        trainer = RemoteConsumer(Coordinator(url), "trainer", tokens={n.node_id: n.proxy.token for n in nodes})
        assert trainer.fleet.node_timeout_s == 1.5
        wait_until(lambda: trainer.fleet.lost_groups(), timeout=15, what="the lost group reported")
        [lost] = trainer.fleet.lost_groups()
        assert (lost.group_id, lost.node_id, lost.serve_url) == (f"node-l-{marker}", "node-l", gone.serve_url)
        assert "has sent no heartbeat" in lost.reason
        batch = trainer.claim()  # the other node's group; the lost one is not handed out
        assert batch.meta["group_id"] == f"node-m-{marker}"
        trainer.ack(batch)
        assert trainer.claim() is None
        counts = fleet.counts()
        assert counts["lost"] == 1 and counts["acked"] == 1 and counts["ready"] == 0
        assert {n["id"]: n["alive"] for n in trainer.fleet.nodes()} == {"node-l": False, "node-m": True}
    finally:
        for node in nodes:
            stop_node(node)
