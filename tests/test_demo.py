"""The README's first command: `stepmill demo` runs the whole lifecycle offline, every stage leaves its data."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stepmill.store import Store

from .conftest import STEPMILL


@pytest.mark.timeout(600)
def test_the_demo_runs_every_stage(tmp_path):
    folder = tmp_path / "demo"
    done = subprocess.run(STEPMILL + ["demo", "--dir", str(folder), "--no-wait"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for stage in ("== setup", "SIMULATED LLM", "== collect", "== represent", "== curate", "== optimize",
                  "== consume", "== review", "== done", 'base_url = "http://your-vllm-host:8000/v1"'):
        assert stage in out, f"{stage!r} missing from:\n{out}"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["runs"] == {"done": 160, "failed": 0, "timed_out": 0}

    store = Store(str(folder / "stepmill.db"), readonly=True)
    # collect + represent: both agents, 20 tasks × 4 rollouts each, every step with exact ids
    rows = store.query("SELECT json_extract(metadata, '$.agent') AS agent, count(*) AS n, sum(status = 'complete') AS done,"
                       " count(DISTINCT group_id) AS groups FROM trajectories GROUP BY 1 ORDER BY 1")
    assert [(r["agent"], r["n"], r["done"], r["groups"]) for r in rows] == [("token-loop", 80, 80, 20),
                                                                           ("tool-loop", 80, 80, 20)]
    isolations = store.query("SELECT DISTINCT json_extract(metadata, '$.isolation') AS isolation FROM trajectories")
    assert [r["isolation"] for r in isolations] == ["sandbox"]  # every run sandboxed, none fell back to none
    steps = store.query("SELECT api, count(*) AS n, sum(token_provenance = 'exact') AS exact FROM steps GROUP BY api")
    assert {r["api"] for r in steps} == {"control", "openai.chat"} and all(r["n"] == r["exact"] for r in steps)
    # curate: every trajectory scored, right and wrong both present, the review pass recorded
    rewards = store.query("SELECT count(*) AS n, sum(value = 1) AS right FROM rewards WHERE name = 'math'")[0]
    assert rewards["n"] == 160 and 0 < rewards["right"] < 160
    assert summary["mixed_groups"] > 0
    reviews = store.query("SELECT count(*) AS n FROM reviews WHERE reviewer = 'stepmill-demo'")[0]["n"]
    assert reviews == 2 * 4 * (40 - summary["mixed_groups"])  # untrainable + tag per trajectory of a flat group
    gate = summary["gate"]
    assert gate["kept"] > 0 and gate["removed"] == sum(gate["removed_by_reason"].values()) > 0
    # optimize: batches on disk and a prefix tree that shares the prompts
    assert list((folder / "batches").glob("steps-*.npz")) and summary["batched_steps"] == gate["kept"]
    assert 0 < summary["tree_ratio"] < 0.6
    # consume: every group handed out once, recorded in the database
    consumed = store.query("SELECT count(*) AS n FROM consumption WHERE status = 'acked' AND consumer = 'demo-trainer'")
    assert consumed[0]["n"] == summary["consumed_groups"] == 40
    # review: the UI answered on the result
    assert summary["ui"].startswith("http://127.0.0.1:")
    assert (folder / "rollout.toml").exists() and (folder / "tasks.jsonl").exists()


def test_init_writes_the_commented_example(tmp_path):
    target = tmp_path / "rollout.toml"
    done = subprocess.run(STEPMILL + ["init", str(target), "--base-url", "http://10.0.0.5:8000/v1"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = target.read_text()
    assert 'base_url = "http://10.0.0.5:8000/v1"' in text and "[[reward]]" in text and "entry =" in text
    from stepmill.runner.config import load

    config = load(target)  # the example is a valid configuration as written
    assert config.run.agent == ["tool-loop", "token-loop"] and config.run.n == 4
    again = subprocess.run(STEPMILL + ["init", str(target)], capture_output=True, text=True)
    assert again.returncode != 0 and "--force" in again.stderr
    subprocess.run(STEPMILL + ["init", str(target), "--recipes", "--force"], check=True, capture_output=True)
    assert {"claude-code", "codex", "mini-swe-agent"} <= set(load(target).agents)


def test_the_demo_says_how_to_install_a_missing_vllm(tmp_path):
    """`--engine vllm` without the engine installed: one line saying how to install it, exit status 1."""
    done = subprocess.run(STEPMILL + ["demo", "--dir", str(tmp_path / "demo"), "--engine", "vllm", "--no-ui"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STEPMILL_VLLM_PYTHON": str(tmp_path / "no-vllm" / "python")})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().startswith("Error: vLLM is not installed: run .ci/install-engines"), done.stderr
    assert "Traceback" not in done.stderr


def _left_behind(folder: Path) -> list[str]:
    """Processes that name ``folder`` on their command line or hold a file in it open."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours
        if str(folder) in cmdline or any(target.startswith(str(folder)) for target in fds):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.timeout(180)
def test_a_stopped_demo_stops_what_it_started(tmp_path):
    """A plain kill in the middle of the rollouts: the simulated LLM, the proxy and the runs stop, and the
    command says it was interrupted, with exit status 130."""
    folder = tmp_path / "demo"
    process = subprocess.Popen(STEPMILL + ["demo", "--dir", str(folder), "--no-ui", "--tasks", "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:
            if line.startswith("== collect"):
                break
        else:
            raise AssertionError(f"the demo never reached its rollouts: {process.stderr.read()[-3000:]}")
        time.sleep(2)  # the proxy and the first runs are up
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "interrupted", stderr[-3000:]
    assert not (folder / "summary.json").exists()
    deadline = time.time() + 10
    while _left_behind(folder) and time.time() < deadline:
        time.sleep(0.2)
    assert _left_behind(folder) == []
