"""Parquet exports through the curation gate, sharded, with a manifest that makes them reproducible.

Two flavours:
- ``tokens`` (verl-style trainers): per step ``prompt_ids``, ``response_ids``, ``logprobs``,
  ``reward``, ``uid`` (group), ``trajectory_id``, ``step_id``, ``step_index``, ``policy_version``,
  ``token_provenance``. Steps without ids are left out and counted.
- ``messages`` (TRL): ``prompt`` (the conversation), ``completion`` (the assistant turn) and
  ``messages`` (both, for SFT) as lists of {role, content, …}, with ``reward``.

The manifest (``manifest.json``) holds the filters, the gate's counts, every source step id, the
schema, the stepmill version and the time. Shards and manifest are 0600, a folder made for them 0700.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

from stepmill import __version__
from stepmill.errors import BadInput
from stepmill.private_files import private_dir, private_opener
from stepmill.store import Store
from stepmill.store.ids import now_iso
from stepmill.protocols.messages import content_text

FLAVOURS = ("tokens", "messages")


def _message(m: dict) -> dict:
    return {"role": m.get("role"), "content": content_text(m.get("content")),
            "tool_calls": json.dumps(m["tool_calls"], ensure_ascii=False) if m.get("tool_calls") else None,
            "tool_call_id": m.get("tool_call_id"), "reasoning_content": m.get("reasoning_content")}


def schema(flavour: str):
    """The Arrow schema of a flavour's rows."""
    import pyarrow as pa

    meta = [("step_id", pa.string()), ("trajectory_id", pa.string()), ("uid", pa.string()),
            ("step_index", pa.int64()), ("policy_version", pa.string()), ("reward", pa.float64()),
            ("model", pa.string()), ("channel", pa.string())]
    if flavour == "tokens":
        return pa.schema(meta + [("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
                                 ("logprobs", pa.list_(pa.float32())), ("token_provenance", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                         ("tool_call_id", pa.string()), ("reasoning_content", pa.string())])
    return pa.schema(meta + [("prompt", pa.list_(message)), ("completion", pa.list_(message)),
                             ("messages", pa.list_(message))])


def export_rows(steps: Iterable[dict], flavour: str, report: Counter | None = None) -> Iterator[dict]:
    """Exported steps as a flavour's rows; steps the flavour cannot use are counted in ``report``."""
    report = Counter() if report is None else report
    for step in steps:
        row = {"step_id": step["step_id"], "trajectory_id": step["trajectory_id"], "uid": step["group_id"],
               "step_index": step["step_index"], "policy_version": step["policy_version"], "reward": step["reward"],
               "model": step["model"], "channel": step["channel"]}
        if flavour == "tokens":
            if step["prompt_ids"] is None or step["response_ids"] is None:
                report["left out: no token ids (run stepmill tokenize)"] += 1
                continue
            row.update(prompt_ids=step["prompt_ids"], response_ids=step["response_ids"], logprobs=step["logprobs"],
                       token_provenance=step["token_provenance"])
        else:
            if not step["completion"]:
                report["left out: no completion"] += 1
                continue
            prompt = [_message(m) for m in step["messages"]]
            completion = [_message(step["completion"])]
            row.update(prompt=prompt, completion=completion, messages=prompt + completion)
        yield row


def export_parquet(store: Store, folder: str | Path, *, flavour: str = "tokens", where: str | None = None,
                   params: Any = (), gate: bool = True, shard_rows: int = 50_000) -> dict:
    """Write the shards and the manifest; returns the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if flavour not in FLAVOURS:
        raise BadInput(f"flavour must be one of {FLAVOURS}")
    folder = private_dir(folder)
    row_schema = schema(flavour)
    report, rows, files, step_ids = Counter(), [], [], []

    def flush():
        if rows:
            name = f"part-{len(files):05d}.parquet"
            with open(folder / name, "wb", opener=private_opener) as out:  # owner only, like the database
                pq.write_table(pa.Table.from_pylist(rows, schema=row_schema), out)
            files.append({"file": name, "rows": len(rows)})
            rows.clear()

    for row in export_rows(store.iter_steps(where, params, with_tokens=flavour == "tokens", gate=gate), flavour,
                           report):
        rows.append(row)
        step_ids.append(row["step_id"])
        if len(rows) >= shard_rows:
            flush()
    flush()
    manifest = {"stepmill": __version__, "created_at": now_iso(), "flavour": flavour, "filters": {
        "where": where, "params": params if isinstance(params, dict) else list(params), "gate": gate},
        "gate": store.gate_counts(where, params), "left_out": dict(report), "rows": len(step_ids),
        "files": files, "schema": row_schema.to_string(), "step_ids": step_ids}
    with open(folder / "manifest.json", "w", opener=private_opener) as out:
        out.write(json.dumps(manifest, indent=1, default=str))
    return manifest
