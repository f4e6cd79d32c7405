"""A Ray node keeps its runs as a local rollout does: beside the node's database in its ``node_dir``
(a runs folder marked as stepmill's), run folders older than ``[run] keep_runs_days`` removed as the
node starts — never in a temporary folder nobody prunes."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from stepmill.fleet.ray_node import Node
from stepmill.runner.config import load
from stepmill.runner.run_folders import ROOT_MARK, RUN_MARK

from .rollout_files import write_rollout


@pytest.mark.slow  # a node starts its own proxy and serve
def test_a_ray_nodes_runs_live_beside_its_database_and_are_pruned(tmp_path):
    marker = uuid.uuid4().hex[:10]
    nodes = tmp_path / "nodes"
    runs_root = nodes / "n1.db.runs"
    old = runs_root / "t1-abcd1234"  # a run of an earlier rollout on this node, ten days ago
    (old / "work").mkdir(parents=True)
    (old / RUN_MARK).touch()
    runs_root.joinpath(ROOT_MARK).touch()
    then = time.time() - 10 * 86400
    for path in (old / RUN_MARK, old / "work", old):
        os.utime(path, (then, then))
    # The node starts its own proxy on its own file: the rollout's [proxy] url and db are not used there.
    elsewhere = SimpleNamespace(url="http://127.0.0.1:9", db=str(tmp_path / "unused.db"), confdir=str(tmp_path / "mitm"))
    config = load(write_rollout(tmp_path, elsewhere, dataset=f"node-{marker}", command=["/usr/bin/python3", "-c", "pass"],
                                tasks=[{"id": "t1", "prompt": "x"}], run="keep_runs_days = 7"))
    node = Node("n1", config, str(nodes))
    try:
        where = Path(node.where.runs_root)
        assert where == runs_root.resolve(), f"the node's runs are not beside its database: {where}"
        assert not old.exists(), "a node's run folder older than keep_runs_days was kept"
        assert oct(where.stat().st_mode & 0o777) == "0o711"
    finally:
        node.stop()
