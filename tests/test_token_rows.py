"""Token rows (``Store.token_rows``): the layouts built from them equal the layouts built from the
export's ids (``token_sequences``' chain walk), on a file with every case the rebuild must get right."""

import numpy as np
import pytest

from bench.bridge import ThroughExport
from stepmill.errors import BadInput
from stepmill.store import StepRecord, Store
from stepmill.trainer_bridge import step_batches, trajectory_batch, trajectory_rows, tree_batch
from stepmill.trainer_bridge.layouts import Batch, group_batch


def _ids(rng, low, high):
    return rng.integers(0, 150_000, rng.integers(low, high)).tolist()


def _step(store, trajectory, group, index, prompt, response, *, logprobs=True, parent=None, **fields):
    """One white-box step, linked to ``parent`` (the step it continues)."""
    rng = np.random.default_rng(len(prompt) * 31 + index)
    return store.record_step(StepRecord(
        api="control", trajectory_id=trajectory, group_id=group, step_index=index, parent_step_id=parent,
        messages=[{"role": "user", "content": f"{trajectory} {index}"}], prompt_ids=prompt, response_ids=response,
        logprobs=(-rng.random(len(response))).tolist() if logprobs else None, token_provenance="exact", **fields))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Groups of multi-turn rollouts: consistent chains, a step that drifts from its parent, a gated-out
    middle step, a branch (two children of one step), a step without ids, one without logprobs, step
    and trajectory rewards, two policy versions, rollouts recorded turn by turn across the group.
    Returns the store and the step ids by (trajectory, turn)."""
    store = Store(tmp_path_factory.mktemp("rows") / "rows.db")
    rng = np.random.default_rng(7)
    system = _ids(rng, 30, 60)
    contexts = {f"t{i}": list(system) for i in range(4)}
    ids: dict = {}
    first: dict = {}
    for turn in range(4):
        for trajectory, context in contexts.items():
            response = _ids(rng, 5, 20)
            prompt = list(context)
            if trajectory == "t1" and turn == 2:
                prompt[len(system)] += 1  # re-rendered: does not continue its parent
            ids[trajectory, turn] = _step(store, trajectory, "g", turn, prompt, response,
                                          parent=ids.get((trajectory, turn - 1)),
                                          logprobs=not (trajectory == "t2" and turn == 1),
                                          policy_version=str(1 + turn // 2),
                                          reward=0.25 if (trajectory == "t3" and turn == 1) else None)
            first.setdefault(trajectory, prompt + response)
            context[:] = prompt + response + _ids(rng, 4, 12)
    # a second child of t0's first step (a branch), in a run of its own
    _step(store, "b", "g", 1, first["t0"] + _ids(rng, 4, 8), _ids(rng, 5, 9), parent=ids["t0", 0])
    store.record_step(StepRecord(api="control", trajectory_id="t9", group_id="g", step_index=0,
                                 messages=[{"role": "user", "content": "no ids"}],
                                 completion={"role": "assistant", "content": "x"}))
    for i in range(3):  # a second group
        context, parent = list(system), None
        for turn in range(3):
            response = _ids(rng, 5, 20)
            parent = _step(store, f"h{i}", "h", turn, context, response, parent=parent)
            context = context + response + _ids(rng, 2, 6)
    store.complete_trajectory("t0", reward=1.0)
    store.complete_trajectory("t3", reward=-1.0)
    store.add_review(ids["t2", 1], "label", "bad", reviewer="test")  # its child continues it: an ancestor left out
    return store, ids


@pytest.fixture(scope="module")
def store(built):
    return built[0]


def _same_batch(a: Batch, b: Batch):
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert np.array_equal(a.tensors[name], b.tensors[name]), name
    assert a.meta == b.meta and a.report == b.report


def _same_rows(a, b):
    (rows_a, report_a), (rows_b, report_b) = a, b
    assert report_a == report_b and len(rows_a) == len(rows_b)
    for x, y in zip(rows_a, rows_b):
        assert (x.trajectory_id, x.group_id, x.step_ids) == (y.trajectory_id, y.group_id, y.step_ids)
        assert x.reward == y.reward
        for name in ("ids", "loss", "logprobs"):
            assert getattr(x, name).dtype == getattr(y, name).dtype
            assert np.array_equal(getattr(x, name), getattr(y, name)), name


@pytest.mark.parametrize("selection", [{}, {"where": "s.step_index > 1"}, {"where": "s.trajectory_id = :t",
                                                                          "params": {"t": "t2"}},
                                       {"group_id": "h"}, {"trajectory_ids": ["t1", "b"]}])
def test_step_batches_equal_the_exports(store, selection):
    options = {"batch_size": 5, "max_prompt_length": 70, "overlong": "truncate"}
    direct = list(step_batches(store, **selection, **options))
    export = list(step_batches(ThroughExport(store), **selection, **options))
    assert len(direct) == len(export) and sum(len(b) for b in direct) > 0
    for a, b in zip(direct, export):
        _same_batch(a, b)


@pytest.mark.parametrize("selection", [{}, {"where": "s.step_index >= 2"}, {"group_id": "g"}])
def test_trajectory_rows_equal_the_exports(store, selection):
    direct, export = trajectory_rows(store, **selection), trajectory_rows(ThroughExport(store), **selection)
    _same_rows(direct, export)
    breaks = direct[1]["new row: a step does not continue its parent token-exactly"]
    assert direct[0] and breaks == (0 if "where" in selection else 2)  # t1's drift; t2's step after the gated one
    _same_batch(trajectory_batch(*direct), trajectory_batch(*export))


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("group", ["g", "h"])
def test_trees_and_group_batches_equal_the_exports(store, group, rows):
    (tree_a, batch_a), (tree_b, batch_b) = tree_batch(store, group, rows=rows), tree_batch(ThroughExport(store), group,
                                                                                          rows=rows)
    _same_batch(batch_a, batch_b)
    assert np.array_equal(tree_a.seq_loss_mask, tree_b.seq_loss_mask) and tree_a.original_tokens > 0
    _same_batch(group_batch(store, group, max_prompt_length=1 << 20), group_batch(ThroughExport(store), group,
                                                                                   max_prompt_length=1 << 20))


def test_token_rows_keep_provenance_order_and_the_gate(built):
    store, ids = built
    rows = list(store.token_rows())
    exported = list(store.iter_steps(gate=True))
    assert [r.step_id for r in rows] == [e["step_id"] for e in exported]
    assert ids["t2", 1] not in {r.step_id for r in rows}  # gated out, yet its child's ids are rebuilt on it
    for row, record in zip(rows, exported):
        assert row.provenance == record["token_provenance"]
        if record["prompt_ids"] is None:
            assert not row.has_ids and row.logprobs is None
            continue
        assert row.prompt_ids.tolist() == record["prompt_ids"] and row.response_ids.tolist() == record["response_ids"]
        assert row.ids().tolist() == record["prompt_ids"] + record["response_ids"]
        assert row.loss_mask().tolist() == [0] * len(record["prompt_ids"]) + [1] * len(record["response_ids"])
        with pytest.raises(ValueError):
            row.prompt_ids[0] = 0  # later steps are rebuilt on these ids
    assert len(list(store.token_rows(gate=False))) == len(rows) + 1
    with pytest.raises(BadInput):
        list(store.token_rows(where="s.no_such_column = 1"))
