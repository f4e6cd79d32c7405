"""The fleet's curated steps as one Ray Dataset, read in parallel where each node's file lies.

Each node of a fleet keeps its steps in its own SQLite file on local disk. ``read_steps`` plans
every file on the Ray node that holds it (how many steps pass the filters, cut into shards of
``rows_per_task``), then reads every shard there too, as a Ray task pinned to that node: the rows
never cross the network as SQLite pages, only as Arrow tables. The rows are those of the Parquet
export (``trainer_bridge/parquet.py``), flavour and schema included, and the curation gate applies
as it does there. Parquet exports of the nodes can be read with ``ray.data.read_parquet`` as they
are.

The Dataset is built from the shards' tables (``ray.data.from_arrow_refs``): reading starts at
once, and the shards stay in Ray's object store while the Dataset is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from stepmill.errors import BadInput
from stepmill.trainer_bridge.parquet import FLAVOURS, export_rows, schema


@dataclass(frozen=True)
class NodeFile:
    """A node's database: its path on that node, and the Ray node id of the node (None: the file is
    readable wherever a task runs, e.g. one machine)."""

    path: str
    node_id: str | None = None


def _pinned(node_id: str | None) -> dict:
    if node_id is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # soft=False: a shard is read where its file is, or not at all (a dead node's file is an error, not
    # an empty result).
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _plan(path: str, where: str | None, params: Any, gate: bool, rows_per_task: int) -> list[tuple[int, int]]:
    from stepmill.store import Store

    store = Store(path, readonly=True)
    try:
        return store.step_shards(rows_per_task, where, params, gate=gate)
    finally:
        store.close()


def _read(path: str, shard: tuple[int, int], flavour: str, where: str | None, params: Any, gate: bool):
    import pyarrow as pa

    from stepmill.store import Store

    store = Store(path, readonly=True)
    try:
        steps = store.iter_steps(where, params, with_tokens=flavour == "tokens", gate=gate, rowids=shard)
        return pa.Table.from_pylist(list(export_rows(steps, flavour)), schema=schema(flavour))
    finally:
        store.close()


def read_steps(files: Iterable[NodeFile | str], *, flavour: str = "tokens", where: str | None = None,
               params: Any = (), gate: bool = True, rows_per_task: int = 10_000):
    """One Ray Dataset of the curated steps of every file, with the Parquet export's rows and schema.

    ``files``: ``NodeFile``s (or plain paths, readable from any node). Needs a running Ray
    (``ray.init()``, or a cluster's address); ``pip install 'stepmill[fleet]'``.
    """
    import ray

    if flavour not in FLAVOURS:
        raise BadInput(f"flavour must be one of {FLAVOURS}")
    files = [f if isinstance(f, NodeFile) else NodeFile(str(f)) for f in files]
    plan = ray.remote(num_cpus=0.25)(_plan)
    read = ray.remote(num_cpus=0.25)(_read)
    plans = ray.get([plan.options(**_pinned(f.node_id)).remote(f.path, where, params, gate, rows_per_task)
                     for f in files])
    refs = [read.options(**_pinned(f.node_id)).remote(f.path, shard, flavour, where, params, gate)
            for f, shards in zip(files, plans) for shard in shards]
    if not refs:
        import pyarrow as pa

        return ray.data.from_arrow(pa.Table.from_pylist([], schema=schema(flavour)))
    return ray.data.from_arrow_refs(refs)
