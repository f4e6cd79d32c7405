"""Trainer layouts on data captured through the proxy from a vLLM-like engine (exact ids)."""

import numpy as np
import openai

from stepmill.trainer_bridge import step_batches, trajectory_batch, trajectory_rows, tree_batch
from stepmill.trainer_bridge.prefix_tree import dense_tree_mask

from .upstream import END, encode_text, render_ids


def _rollout(trajectory: str, group: str, first: str, turns: int = 3):
    client = openai.OpenAI(api_key="sk-x", base_url="https://engine.local/v1", max_retries=0,
                           default_headers={"X-Stepmill-Trajectory": trajectory, "X-Stepmill-Group": group})
    messages = [{"role": "user", "content": first}]
    for turn in range(turns):
        answer = client.chat.completions.create(model="qwen-engine", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"observation {turn}"}]
    return messages


def test_step_layout(proxy, marker):
    _rollout(f"layout-{marker}", f"grp-{marker}", f"steps {marker}", turns=2)
    proxy.trajectory_steps(f"layout-{marker}", 2)
    proxy.client().reward(f"layout-{marker}", 1.0, source="env")
    store = proxy.store()
    [batch] = list(step_batches(store, where="s.trajectory_id = ?", params=[f"layout-{marker}"]))
    t = batch.tensors
    assert len(batch) == 2 and batch.meta["uid"] == [f"grp-{marker}"] * 2 and batch.meta["step_index"] == [0, 1]
    first_prompt = render_ids([{"role": "user", "content": f"steps {marker}"}])
    row0 = t["prompts"][0][t["attention_mask"][0, :t["prompts"].shape[1]] == 1]
    assert row0.tolist() == first_prompt  # left-padded prompt, exactly the engine's ids
    response0 = t["responses"][0][t["response_mask"][0] == 1]
    assert response0.tolist() == encode_text(f"Echo: steps {marker}") + [END]
    assert t["input_ids"].shape[1] == t["prompts"].shape[1] + t["responses"].shape[1]
    last = int(t["response_mask"][0].sum()) - 1
    assert t["token_level_scores"][0, last] == 1.0 and t["token_level_scores"][0].sum() == 1.0
    assert t["rollout_log_probs"][0, 0] != 0 and (t["position_ids"][0][t["attention_mask"][0] == 1] ==
                                                   np.arange(t["attention_mask"][0].sum())).all()
    # overlong rows: dropped or truncated, and counted either way
    [dropped] = list(step_batches(store, where="s.trajectory_id = ?", params=[f"layout-{marker}"], max_prompt_length=10))
    assert len(dropped) == 0 and dropped.report["dropped: overlong"] == 2
    [cut] = list(step_batches(store, where="s.trajectory_id = ?", params=[f"layout-{marker}"], max_prompt_length=10,
                              overlong="truncate"))
    assert len(cut) == 2 and cut.tensors["prompts"].shape[1] == 10 and cut.report["truncated: overlong"] == 2


def test_trajectory_layout_and_row_breaks(proxy, marker):
    messages = _rollout(f"rows-{marker}", f"grp-{marker}", f"rows {marker}", turns=3)
    _rollout(f"drift-{marker}", f"grp-{marker}", f"[[drift]] {marker}", turns=2)
    proxy.trajectory_steps(f"rows-{marker}", 3)
    proxy.trajectory_steps(f"drift-{marker}", 2)
    store = proxy.store()
    rows, report = trajectory_rows(store, where="s.trajectory_id IN (?, ?)", params=[f"rows-{marker}", f"drift-{marker}"])
    by_id = {}
    for row in rows:
        by_id.setdefault(row.trajectory_id, []).append(row)
    [whole] = by_id[f"rows-{marker}"]
    assert len(whole.step_ids) == 3
    assert whole.ids.tolist() == render_ids(messages[:-2]) + encode_text(messages[-2]["content"]) + [END]
    sampled = [t for t, m in zip(whole.ids, whole.loss) if m]
    assert sampled == sum((encode_text(m["content"]) + [END] for m in messages if m["role"] == "assistant"), [])
    assert len(by_id[f"drift-{marker}"]) == 2  # the drifted step starts a new row
    assert report["new row: a step does not continue its parent token-exactly"] == 1
    batch = trajectory_batch(rows, report)
    assert batch.tensors["input_ids"].shape[0] == 3 and batch.tensors["response_mask"].sum() == sum(r.loss.sum() for r in rows)


def test_tree_layout_of_a_group(proxy, marker):
    for i in range(3):
        _rollout(f"tree-{marker}-{i}", f"tree-grp-{marker}", f"tree {marker}", turns=2)
        proxy.trajectory_steps(f"tree-{marker}-{i}", 2)
    store = proxy.store()
    tree, batch = tree_batch(store, f"tree-grp-{marker}")
    assert len(batch.meta["step_id"]) == 6 and tree.token_ratio < 0.4  # identical rollouts share everything
    steps = {s["step_id"]: s for s in store.iter_steps("s.group_id = ?", [f"tree-grp-{marker}"])}
    for i, step_id in enumerate(batch.meta["step_id"]):
        assert tree.input_ids[tree.sequence(i)].tolist() == steps[step_id]["prompt_ids"] + steps[step_id]["response_ids"]
    assert dense_tree_mask(tree.subtree_end).sum() < len(tree.input_ids) ** 2
    _, rows_batch = tree_batch(store, f"tree-grp-{marker}", rows=True)
    assert len(rows_batch.meta["trajectory_id"]) == 3


def test_cli_writes_batches(proxy, marker, tmp_path):
    import json
    import subprocess

    from .conftest import STEPMILL

    _rollout(f"cli-{marker}", f"cli-grp-{marker}", f"cli {marker}", turns=2)
    proxy.trajectory_steps(f"cli-{marker}", 2)
    for layout in ("step", "trajectory", "tree"):
        out = tmp_path / layout
        done = subprocess.run(STEPMILL + ["batches", "--db", str(proxy.db), "--layout", layout, "--out", str(out),
                                          "--where", "s.trajectory_id = :t", "-p", "t", f"cli-{marker}",
                                          "--group", f"cli-grp-{marker}"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        arrays = np.load(out / "batch-00000.npz")
        assert "input_ids" in arrays and json.loads((out / "batch-00000.json").read_text())["meta"]


def test_parquet_exports_read_back_with_pyarrow_and_datasets(proxy, marker, tmp_path):
    import json
    import subprocess

    import datasets
    import pyarrow.parquet as pq

    from .conftest import STEPMILL

    messages = _rollout(f"pq-{marker}", f"pq-grp-{marker}", f"parquet {marker}", turns=2)
    steps = proxy.trajectory_steps(f"pq-{marker}", 2)
    proxy.client().reward(f"pq-{marker}", 0.5, source="env")
    for flavour in ("tokens", "messages"):
        out = tmp_path / flavour
        done = subprocess.run(STEPMILL + ["export", "--db", str(proxy.db), "--format", "parquet", "--flavour", flavour,
                                          "--out", str(out), "--where", "s.trajectory_id = :t", "-p", "t",
                                          f"pq-{marker}"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["rows"] == 2 and manifest["step_ids"] == [s["step_id"] for s in steps]
        assert manifest["filters"]["params"] == {"t": f"pq-{marker}"} and manifest["gate"]["removed"] == 0
        table = pq.read_table(out / "part-00000.parquet")
        loaded = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train")
        assert table.num_rows == len(loaded) == 2 and loaded[0]["reward"] == 0.5
        if flavour == "tokens":
            assert loaded[1]["prompt_ids"] == steps[1]["prompt_ids"] and loaded[1]["uid"] == f"pq-grp-{marker}"
        else:
            assert loaded[1]["completion"][0]["content"] == messages[3]["content"]
            assert [m["role"] for m in loaded[1]["messages"]] == ["user", "assistant", "user", "assistant"]


def test_a_verl_dataproto_when_verl_is_installed(proxy, marker):
    import pytest

    pytest.importorskip("verl")
    _rollout(f"verl-{marker}", f"verl-grp-{marker}", f"verl {marker}", turns=2)
    proxy.trajectory_steps(f"verl-{marker}", 2)
    [batch] = list(step_batches(proxy.store(), where="s.trajectory_id = ?", params=[f"verl-{marker}"]))
    proto = batch.to_dataproto()
    assert len(proto) == 2 and proto.batch["input_ids"].shape == batch.tensors["input_ids"].shape
    assert list(proto.non_tensor_batch["uid"]) == [f"verl-grp-{marker}"] * 2


def test_a_groups_batch_of_some_runs_and_bad_options(tmp_path):
    import pytest

    from stepmill.errors import BadInput
    from stepmill.store import StepRecord, Store
    from stepmill.trainer_bridge.layouts import group_batch
    from stepmill.trainer_bridge.parquet import export_parquet

    store = Store(tmp_path / "g.db")
    for run in ("t-1", "t-2", "t-3"):
        store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": run}],
                                     completion={"role": "assistant", "content": "a"}, trajectory_id=run,
                                     group_id="g", prompt_ids=[1, 2], response_ids=[3], token_provenance="exact"))
    batch = group_batch(store, "g", trajectory_ids=["t-3", "t-1"])
    assert sorted(batch.meta["trajectory_id"]) == ["t-1", "t-3"] and batch.meta["group_id"] == "g"
    assert len(group_batch(store, "g")) == 3 and len(group_batch(store, "g", trajectory_ids=[])) == 0
    with pytest.raises(BadInput, match="overlong must be one of"):
        group_batch(store, "g", overlong="squeeze")
    with pytest.raises(BadInput, match="flavour must be one of"):
        export_parquet(store, tmp_path / "out", flavour="pixels")
