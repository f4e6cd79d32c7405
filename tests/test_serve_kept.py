"""`[run] serve = "keep"`: a Ray rollout's nodes keep serving their files after the rollout ends, until
the coordinator says their groups are consumed, so a trainer still consuming needs nothing started by
hand; the next rollout on a node stops its earlier keeper (it serves the file itself while it runs),
`stepmill fleet serve --stop` ends one node's serving early, and `stepmill fleet serve --node` serves it
again.

A local two-node Ray cluster, a real PostgreSQL coordinator, the shipped tool-loop agent against the
simulated LLM, a trainer (`RemoteConsumer`) in its own process that starts after the rollout exited.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from .conftest import STEPMILL, wait_until
from .fleet_processes import acks_by_group, events, start_consumer
from .test_ray_rollout import _config, _files, _left_behind, _rollout, _trajectories

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stepmill[fleet]'")
pytestmark = pytest.mark.slow


def _keeps(pid: int, node: str) -> bool:
    """Whether the process is alive and a `fleet serve --node` of the node."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return node.encode() in argv and b"fleet" in argv


def _keeper(nodes: Path, node: str) -> int | None:
    """The pid of the node's keeper while it runs (its pid file names a live `fleet serve --node` of it)."""
    pid_file = nodes / f"{node}.keep.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    return pid if pid and _keeps(pid, node) else None


@pytest.mark.timeout(600)
def test_kept_serves_outlive_the_rollout_until_a_trainer_consumed_every_group(ray_cluster, url, simulated_llm,
                                                                              marker, tmp_path):
    from stepmill.store.fleet_ledger import Coordinator

    config = _config(tmp_path, simulated_llm.url, marker, url, ray_cluster)
    config.write_text(config.read_text().replace(f'coordinator = "{url}"\n', f'coordinator = "{url}"\nserve = "keep"\n'))
    done = _rollout(config)
    assert done.returncode == 0, done.stderr
    nodes = tmp_path / "nodes"
    files = _files(tmp_path)
    assert len(files) == 2
    kept = {node: _keeper(nodes, node) for node in files}
    assert all(kept.values()), (kept, done.stderr)  # the rollout has exited; its nodes' files are still served

    shown = subprocess.run(STEPMILL + ["fleet", "--coordinator", url], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    for node in files:
        assert f"node {node}: serve kept: until its groups are consumed" in shown.stdout, shown.stdout
    assert "DOES NOT ANSWER" not in shown.stdout, shown.stdout

    # The same rollout again (every run done earlier): its nodes serve their files themselves while it runs,
    # so the earlier keepers stop as it starts; new ones keep serving after it.
    resumed = _rollout(config)
    assert resumed.returncode == 0 and "8 done earlier" in resumed.stderr, resumed.stderr
    earlier, kept = kept, {node: _keeper(nodes, node) for node in files}
    assert all(kept.values()) and not set(kept.values()) & set(earlier.values()), (earlier, kept)
    assert not any(_keeps(pid, node) for node, pid in earlier.items()), earlier

    # One node's serving stopped early; `fleet serve --node` serves it again, from the coordinator's URL.
    stopped_node, other = sorted(files)
    stop = subprocess.run(STEPMILL + ["fleet", "serve", str(config), "--node", stopped_node, "--stop"],
                          capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and f"stopped the serving of {stopped_node}" in stop.stderr, stop.stderr
    assert _keeper(nodes, stopped_node) is None and _keeper(nodes, other) == kept[other]
    assert not _left_behind(f"--node-id {stopped_node}"), "the stopped keeper's serve outlived it"
    again_log = tmp_path / "serve-again.log"
    again = subprocess.Popen(STEPMILL + ["fleet", "serve", str(config), "--node", stopped_node, "--until-consumed"],
                             stderr=again_log.open("wb"))
    try:
        wait_until(lambda: again.poll() is not None or f"node {stopped_node} at http://" in again_log.read_text(),
                   timeout=120, interval=0.5, what=f"{stopped_node} served again")
        assert again.poll() is None, again_log.read_text()

        # A trainer started after the rollout consumed every group, each once; then both servings end by themselves.
        token = (tmp_path / "mitm" / "stepmill-token").read_text().strip()
        groups = {row["group_id"] for path in files.values() for row in _trajectories(path, marker).values()}
        out = tmp_path / "consumers.jsonl"
        trainer = start_consumer(url, "trainer", {name: token for name in files}, out, lease=30, expect=len(groups))
        assert trainer.wait(300) == 0, (tmp_path / "trainer.err").read_text()
        assert again.wait(60) == 0, again_log.read_text()
    finally:
        if again.poll() is None:
            again.kill()
    wait_until(lambda: _keeper(nodes, other) is None, timeout=60, interval=0.5, what=f"{other}'s keeper ending")
    assert "is consumed" in (nodes / f"{other}.keep.log").read_text()
    assert not _left_behind(str(nodes)), "a kept serve outlived the consumption of its groups"
    acked = [e for e in events(out) if e["event"] == "acked"]
    assert Counter(e["group"] for e in acked) == Counter(groups)
    with Coordinator(url) as fleet:
        assert acks_by_group(fleet, groups) == Counter(groups)
