"""Reading a fleet's files with Ray Data: a local Ray cluster of several nodes, one SQLite file per node.

Each read task is pinned to the node that holds its file; the Dataset holds exactly the rows the
nodes' own Parquet exports hold (the gate applies, steps without ids are left out of ``tokens``).
"""

from __future__ import annotations

import os

import pytest

from stepmill.store import StepRecord, Store
from stepmill.trainer_bridge.parquet import export_parquet

from .conftest import RAY_NODES

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stepmill[fleet]'")


def fill(path: str, node: int) -> None:
    """A node's file: groups of runs with exact ids, one run reviewed bad, one step without ids."""
    store = Store(path)
    for group in range(node + 1):
        for run in range(2):
            trajectory = f"n{node}-g{group}-r{run}"
            for step in range(2):
                store.record_step(StepRecord(
                    api="openai.chat", model="m", trajectory_id=trajectory, group_id=f"n{node}-g{group}",
                    messages=[{"role": "user", "content": f"task {group} turn {step}"}],
                    completion={"role": "assistant", "content": "ok"}, finish_reason="stop",
                    prompt_ids=[1, 2, 3 + step], response_ids=[4, 5], logprobs=[-0.1, -0.2],
                    token_provenance="exact", policy_version=str(node)))
    store.record_step(StepRecord(api="openai.chat", model="m", trajectory_id=f"n{node}-plain",
                                 group_id=f"n{node}-plain", messages=[{"role": "user", "content": "no ids"}],
                                 completion={"role": "assistant", "content": "ok"}))
    store.add_review(f"n{node}-g0-r1", "label", "bad", reviewer="test")
    store.close()


@pytest.fixture(scope="module")
def node_files(ray_cluster, tmp_path_factory):
    """(path, Ray node id) of a file on each node of the test cluster."""
    folder = tmp_path_factory.mktemp("node_files")
    node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(node_ids) == RAY_NODES
    files = []
    for index, node_id in enumerate(node_ids):
        path = str(folder / f"node-{index}.db")
        fill(path, index)
        files.append((path, node_id))
    return files


def exported(path: str, flavour: str, tmp_path) -> list[str]:
    return export_parquet(Store(path, readonly=True), tmp_path / os.path.basename(path), flavour=flavour)["step_ids"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", ["tokens", "messages"])
def test_the_dataset_is_the_sum_of_the_nodes_exports(node_files, flavour, tmp_path):
    from stepmill.fleet.ray_dataset import NodeFile, read_steps

    dataset = read_steps([NodeFile(path, node_id) for path, node_id in node_files], flavour=flavour, rows_per_task=3)
    rows = dataset.take_all()
    expected = [step for path, _ in node_files for step in exported(path, flavour, tmp_path)]
    assert dataset.count() == len(expected) == len(rows)
    assert sorted(r["step_id"] for r in rows) == sorted(expected)
    assert not any(r["trajectory_id"].endswith("-g0-r1") for r in rows)  # reviewed bad: the gate holds it back
    if flavour == "tokens":
        assert all(r["response_ids"] is not None and len(r["response_ids"]) == 2 for r in rows)
        assert not any(r["trajectory_id"].endswith("-plain") for r in rows)


def test_shards_cover_a_file_exactly(node_files):
    path = node_files[-1][0]
    store = Store(path, readonly=True)
    everything = [s["step_id"] for s in store.iter_steps(with_tokens=False, gate=True)]
    shards = store.step_shards(4, gate=True)
    assert all(lo <= hi for lo, hi in shards) and len(shards) == -(-len(everything) // 4)
    pieces = [s["step_id"] for shard in shards for s in store.iter_steps(with_tokens=False, gate=True, rowids=shard)]
    assert sorted(pieces) == sorted(everything)


def test_a_task_reads_only_on_its_node(node_files):
    """The scheduling that pins a file's tasks puts them on that node, on every node of the cluster."""
    from stepmill.fleet.ray_dataset import _pinned

    @ray.remote(num_cpus=0.25)
    def where_am_i():
        return ray.get_runtime_context().get_node_id()

    for _, node_id in node_files:
        assert ray.get(where_am_i.options(**_pinned(node_id)).remote()) == node_id
