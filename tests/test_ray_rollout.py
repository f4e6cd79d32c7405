"""`[run] executor = "ray"`: a rollout on a local Ray cluster of several nodes, a real PostgreSQL coordinator.

Each node's actor starts its own `stepmill proxy` (its own SQLite file) and `stepmill serve`; the runs
are Ray tasks pinned to their node, with the shipped black-box agent against the simulated LLM. Every
run's steps are in exactly one node's file, the coordinator knows which and sees every group ready,
Ray Data reads exactly the nodes' gated steps, Ctrl-C stops every node's processes, and a resume runs
only what is missing.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import signal
import subprocess
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from stepmill.errors import StoreUnavailable
from stepmill.store import Store

from .conftest import STEPMILL, wait_until
from .fleet_processes import acks_by_group, events, start_consumer, start_serve

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stepmill[fleet]'")
NODES = 2
TASKS = 4  # n = 2 each: 8 runs, 4 groups, 2 on each node






def _config(tmp_path: Path, llm_url: str, marker: str, coordinator: str, ray_cluster, *, command: list | None = None,
            prompts=None) -> Path:
    bundled = (importlib.resources.files("stepmill") / "data" / "arith20.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in bundled[:TASKS]]
    for task, prompt in zip(tasks, prompts or []):
        task["prompt"] = prompt
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks))
    command = command or ["{python}", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]
    config = tmp_path / "rollout.toml"
    config.write_text(f"""
[proxy]
confdir = "{tmp_path / 'mitm'}"

[route]
base_url = "{llm_url}"

[[agent]]
name = "tool-loop"
command = {json.dumps(command)}
env = {{ OPENAI_API_KEY = "sk-local" }}

[[dataset]]
name = "ray-{marker}"
path = "tasks.jsonl"

[run]
agent = "tool-loop"
dataset = "ray-{marker}"
n = 2
concurrency = 2
timeout = 120
model = "qwen-sim"
policy_version = 3
executor = "ray"
ray_address = "{ray_cluster.address}"
runs_per_node = 2
node_dir = "{tmp_path / 'nodes'}"
coordinator = "{coordinator}"

[[reward]]
name = "math-{marker}"
function = "stepmill.rewards.functions:math_answer"
""")
    return config


def _rollout(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=300)


def _files(tmp_path: Path) -> dict[str, str]:
    """node name -> its file."""
    return {path.stem: str(path) for path in sorted((tmp_path / "nodes").glob("*.db"))}


def _trajectories(path: str, marker: str) -> dict[str, dict]:
    try:
        store = Store(path, readonly=True)
    except StoreUnavailable:  # a node's file not made yet, or its schema not written yet
        return {}
    try:
        return {row["id"]: row for row in store.query("SELECT id, group_id, status FROM trajectories WHERE id LIKE ?",
                                                      [f"ray-{marker}-%"])}
    finally:
        store.close()


def _left_behind(*needles: str) -> list[str]:
    """Command lines of live processes that name any of ``needles`` (a node's files, an agent's marker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "zombie" not in state and any(needle in cmdline for needle in needles):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=3).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


@pytest.mark.timeout(400)
def test_runs_on_every_node_each_in_one_file_ready_in_the_coordinator(ray_cluster, url, simulated_llm, marker,
                                                                      tmp_path):
    from stepmill.store.fleet_ledger import Coordinator
    from stepmill.fleet.ray_dataset import NodeFile, read_steps

    from stepmill.fleet.ray_rollout import node_names

    config = _config(tmp_path, simulated_llm.url, marker, url, ray_cluster)
    done = _rollout(config)
    assert done.returncode == 0, done.stderr
    assert "8 runs finished (0 failed, 0 timed out), 0 done earlier, of 8" in done.stderr, done.stderr
    assert f"reward math-{marker}: scored 8, failed 0" in done.stderr

    files = _files(tmp_path)
    assert len(files) == NODES
    held = {name: _trajectories(path, marker) for name, path in files.items()}
    everywhere = [t for rows in held.values() for t in rows]
    assert sorted(everywhere) == sorted(f"ray-{marker}-t0{i}-{k}" for i in range(1, TASKS + 1) for k in range(2))
    assert all(rows for rows in held.values()), "every node ran some runs"
    for rows in held.values():  # whole groups: a group's runs are all in one file
        assert {row["status"] for row in rows.values()} == {"complete"}
        groups = {row["group_id"] for row in rows.values()}
        assert all(sum(row["group_id"] == g for row in rows.values()) == 2 for g in groups)

    with Coordinator(url) as fleet:
        assert {n["id"] for n in fleet.nodes()} == set(files)
        for name, rows in held.items():
            for trajectory, row in rows.items():
                group = fleet.group(row["group_id"])
                assert group["ready"] and group["size"] == 2 and group["policy_version"] == "3"
                assert group["runs"][trajectory]["node_id"] == name
        assert fleet.counts()["ready"] == TASKS

    # Ray Data over the nodes' files, each read on its node: exactly the nodes' gated steps.
    names = node_names([n for n in ray.nodes() if n["Alive"]])
    ray_ids = {name: node_id for node_id, name in names.items()}
    dataset = read_steps([NodeFile(path, ray_ids[name]) for name, path in files.items()], flavour="messages")
    gated, runs_with_steps = 0, set()
    for path in files.values():
        store = Store(path, readonly=True)
        gated += sum(1 for _ in store.iter_steps(with_tokens=False, gate=True))
        runs_with_steps |= {r["trajectory_id"] for r in store.query("SELECT DISTINCT trajectory_id FROM steps")}
        store.close()
    assert runs_with_steps == set(everywhere)  # every run's calls, recorded by its node's proxy
    assert gated > 0 and dataset.count() == gated

    again = _rollout(config)  # resume: everything finished, nothing runs again
    assert again.returncode == 0, again.stderr
    assert "0 runs finished (0 failed, 0 timed out), 8 done earlier, of 8" in again.stderr
    assert not _left_behind(str(tmp_path / "nodes")), "a node's proxy or serve outlived the rollout"

    # Trainers on the fleet: each node's file served again (the rollout's serves stopped with it), three
    # RemoteConsumer processes, one killed holding a claim: every group consumed exactly once, every
    # gated step with ids fetched from the node that holds it.
    token = (tmp_path / "mitm" / "stepmill-token").read_text().strip()
    serves = [start_serve(name, path, tmp_path / "mitm", url, tmp_path)[0] for name, path in files.items()]
    try:
        groups = {row["group_id"] for rows in held.values() for row in rows.values()}
        tokens = {name: token for name in files}
        out = tmp_path / "consumers.jsonl"
        doomed = start_consumer(url, "doomed", tokens, out, lease=2, die=True)
        wait_until(lambda: any(e["event"] == "claimed" for e in events(out)), timeout=60, what="a claim")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        trainers = [start_consumer(url, f"trainer-{k}", tokens, out, hold=0.1, lease=2, expect=len(groups))
                    for k in range(2)]
        for trainer in trainers:
            assert trainer.wait(120) == 0, (tmp_path / "trainer-0.err").read_text()
        acked = [e for e in events(out) if e["event"] == "acked"]
        assert Counter(e["group"] for e in acked) == Counter(groups)
        with Coordinator(url) as fleet:
            assert acks_by_group(fleet, groups) == Counter(groups)
        with_ids = 0
        for path in files.values():
            store = Store(path, readonly=True)
            with_ids += sum(1 for s in store.iter_steps(gate=True) if s["response_ids"] is not None)
            store.close()
        assert sum(e["rows"] for e in acked) == with_ids > 0
    finally:
        for serve in serves:
            serve.terminate()
            serve.wait(10)


@pytest.mark.timeout(400)
def test_ctrl_c_stops_every_node_and_resume_runs_what_is_missing(ray_cluster, url, simulated_llm, marker,
                                                               tmp_path):
    from stepmill.store.fleet_ledger import Coordinator

    # Tasks 3 and 4 are slow: the first two groups finish, the last two are running when Ctrl-C comes.
    prompts = ["quick", "quick", "SLOW", "SLOW"]
    slow = ["{python}", "-c", f"import sys, time; time.sleep(120 if 'SLOW' in sys.stdin.read() else 0)  # {marker}"]
    config = _config(tmp_path, simulated_llm.url, marker, url, ray_cluster, command=slow, prompts=prompts)
    log = tmp_path / "rollout.log"
    with log.open("wb") as out:  # a file, not a pipe: nothing the runner prints can block it
        process = subprocess.Popen(STEPMILL + ["rollout", str(config), "--no-progress"], stderr=out)
    try:
        def four_done_four_running():
            complete = [t for path in _files(tmp_path).values()
                        for t, row in _trajectories(path, marker).items() if row["status"] == "complete"]
            agents = [line for line in _left_behind(marker) if "bwrap" not in line and "time.sleep" in line]
            return len(complete) == 4 and len(agents) >= 4

        wait_until(lambda: process.poll() is not None or four_done_four_running(), timeout=120,
                   interval=0.5, what="four runs done, four running")
        assert process.poll() is None, log.read_text()
        urls = re.findall(r"proxy (http://[^\s,]+), serve (http://[^\s,]+)", log.read_text())
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
        stderr = log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130 and "run the same command again to resume" in stderr, stderr
    assert not _left_behind(marker, str(tmp_path / "nodes")), "an agent or a node's process outlived Ctrl-C"
    assert len(urls) == NODES
    assert not any(_answers(proxy) or _answers(f"{serve}/v1/health") for proxy, serve in urls)
    statuses = sorted(row["status"] for path in _files(tmp_path).values() for row in _trajectories(path, marker).values())
    assert statuses == ["complete"] * 4 + ["open"] * 4
    with Coordinator(url) as fleet:  # the groups that finished are ready already; the cut ones wait
        counts = fleet.counts()
        assert (counts["ready"], counts["waiting"]) == (2, 2), counts

    quick = _config(tmp_path, simulated_llm.url, marker, url, ray_cluster,
                    command=["{python}", "-c", "print('done')"], prompts=prompts)
    done = _rollout(quick)
    assert done.returncode == 0, done.stderr
    assert "4 runs finished (0 failed, 0 timed out), 4 done earlier, of 8" in done.stderr, done.stderr
    with Coordinator(url) as fleet:
        assert fleet.counts()["ready"] == TASKS


@pytest.mark.parametrize("run,proxy,message", [
    ('executor = "cluster"', "", ":{line}: run.executor: must be one of local, ray"),
    ('runs_per_node = 2', "", ':{line}: run.runs_per_node: applies to executor = "ray" only'),
    ('executor = "ray"\nruns_per_node = 0', "", ":{line}: run.runs_per_node: a positive integer is required"),
    ('executor = "ray"\ncoordinator = "mysql://x"', "", ":{line}: run.coordinator: a postgresql:// URL is required"),
    ('executor = "ray"\nretries = -1', "", ":{line}: run.retries: a whole number, 0 or more, is required"),
    ('retries = 2', "", ':{line}: run.retries: applies to executor = "ray" only'),
    ('executor = "ray"\nserve = "forever"', "", ":{line}: run.serve: must be one of stop, keep"),
    ('serve = "keep"', "", ':{line}: run.serve: applies to executor = "ray" only'),
    ('executor = "ray"', '[proxy]\nurl = "http://127.0.0.1:8080"\n',
     ':{line}: proxy.url: executor = "ray" starts a proxy on each node'),
])
def test_ray_configuration_errors_name_the_key_and_line(tmp_path, run, proxy, message):
    text = (f'{proxy}[[agent]]\nname = "a"\ncommand = ["true"]\n\n[[dataset]]\nname = "x"\npath = "t.jsonl"\n\n'
            f'[run]\nagent = "a"\ndataset = "x"\n{run}\n')
    config = tmp_path / "bad.toml"
    config.write_text(text)
    key = message.split(": ")[1].split(".")[1]
    line = max(i for i, content in enumerate(text.splitlines(), start=1) if content.startswith(f"{key} ="))
    done = subprocess.run(STEPMILL + ["rollout", str(config)], capture_output=True, text=True)
    assert done.returncode != 0 and message.format(line=line) in done.stderr, done.stderr


def test_serve_keep_without_a_coordinator_is_refused_before_ray_starts(tmp_path):
    config = tmp_path / "keep.toml"
    config.write_text('[[agent]]\nname = "a"\ncommand = ["true"]\n\n[[dataset]]\nname = "x"\npath = "t.jsonl"\n\n'
                      '[run]\nagent = "a"\ndataset = "x"\nexecutor = "ray"\nray_address = "127.0.0.1:1"\n'
                      'serve = "keep"\n\n[isolation]\nmode = "none"\n')
    (tmp_path / "t.jsonl").write_text('{"id": "1", "prompt": "p"}\n')
    env = {k: v for k, v in os.environ.items() if k != "STEPMILL_COORDINATOR"}
    done = subprocess.run(STEPMILL + ["rollout", str(config)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and '[run] serve = "keep"' in done.stderr and "needs a coordinator" in done.stderr, \
        done.stderr


def test_groups_stay_whole_and_go_back_where_they_were():
    from stepmill.runner.agent_run import Job
    from stepmill.fleet.ray_rollout import node_names, place

    jobs = [Job(None, {}, f"g{g}-{i}", f"g{g}") for g in range(5) for i in range(3)]
    placed = place(jobs, ["a", "b"], {"a": {}, "b": {}})
    assert sorted(placed) == [f"g{g}" for g in range(5)]
    assert sorted(list(placed.values()).count(n) for n in ("a", "b")) == [2, 3]  # balanced by runs
    # A group an earlier rollout began on b goes back to b, whatever the balance says.
    again = place(jobs, ["a", "b"], {"a": {}, "b": {"g0-2": "open", "g2-0": "complete"}})
    assert again["g0"] == "b" and again["g2"] == "b"
    shared = node_names([{"NodeID": "0123456789ab", "NodeManagerAddress": "10.0.0.1"},
                         {"NodeID": "abcdef012345", "NodeManagerAddress": "10.0.0.1"},
                         {"NodeID": "fedcba987654", "NodeManagerAddress": "10.0.0.2"}])
    assert shared == {"0123456789ab": "node-10.0.0.1-01234567", "abcdef012345": "node-10.0.0.1-abcdef01",
                      "fedcba987654": "node-10.0.0.2"}
