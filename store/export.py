"""Steps as exported records: the JSONL export, the control API's step view and the trainer bridge."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from stepmill.errors import BadInput, NotFound
from stepmill.store import curation
from stepmill.store.blobs import Blobs
from stepmill.store.connection import Transactions
from stepmill.store.encoding import loads
from stepmill.store.history import History
from stepmill.store.sql_errors import UserParameters, user_rows
from stepmill.store.token_ids import TokenIds


class Export:
    """One step, or the selected steps in capture order, as exported records: the row with its
    request (``blobs``), its conversation (``history``) and its token ids (``token_ids``)."""

    def __init__(self, tx: Transactions, blobs: Blobs, history: History, token_ids: TokenIds):
        self.tx = tx
        self.blobs = blobs
        self.history = history
        self.token_ids = token_ids

    def step(self, step_id: str, *, with_tokens: bool = True) -> dict:
        rows = self.tx.query(
            "SELECT s.*, t.reward AS trajectory_reward FROM steps s"
            " LEFT JOIN trajectories t ON t.id = s.trajectory_id WHERE s.id = ?", [step_id]
        )
        if not rows:
            raise NotFound(step_id)
        return self._export(rows[0], with_tokens=with_tokens)

    def _export(self, row: dict, *, with_tokens: bool = True) -> dict:
        request = self.blobs.get(row["request_hash"]) or {}
        record = {
            "step_id": row["id"],
            "trajectory_id": row["trajectory_id"],
            "group_id": row["group_id"],
            "parent_step_id": row["parent_step_id"],
            "step_index": row["step_index"],
            "api": row["api"],
            "transport": row["transport"],
            "host": row["host"],
            "model": row["model"],
            "response_id": row["response_id"],
            "messages": self.history.messages(row["id"]),
            "tools": request.get("tools"),
            "completion": loads(row["completion"]),
            "finish_reason": row["finish_reason"],
            "usage": None if row["usage"] is None and row["input_tokens"] is None else {
                "input_tokens": row["input_tokens"], "output_tokens": row["output_tokens"],
                "cache_read_tokens": row["cache_read_tokens"], "cache_write_tokens": row["cache_write_tokens"],
                "raw": loads(row["usage"]),
            },
            "status": row["status"],
            "error": row["error"],
            "ttft_ms": row["ttft_ms"],
            "duration_ms": row["duration_ms"],
            "started_at": row["started_at"],
            "channel": row["channel"],
            "policy_version": row["policy_version"],
            "reward": row["reward"] if row["reward"] is not None else row.get("trajectory_reward"),
            "token_provenance": row["token_provenance"] or "none",
            "prompt_ids": None,
            "response_ids": None,
            "logprobs": None,
        }
        if with_tokens and row["prompt_len"] is not None:
            prompt, response, logprobs = self.token_ids.token_sequences(row["id"])
            record["prompt_ids"] = prompt.tolist()
            record["response_ids"] = response.tolist()
            record["logprobs"] = None if logprobs is None else [float(x) for x in logprobs]
        record["engine_api"] = row["engine_api"]
        record["params"] = request.get("params")
        record["metadata"] = loads(row["metadata"])
        record["system_changed"] = None if row["system_changed"] is None else bool(row["system_changed"])
        record["token_check"] = {
            "consistency": row["consistency"],
            "divergence_pos": row["divergence_pos"],
            "divergence_reason": row["divergence_reason"],
            "spliced_len": row["spliced_len"],
            "fidelity": row["fidelity"],
            "fidelity_detail": row["fidelity_detail"],
            "tokenizer": row["tokenizer"],
        }
        return record

    def iter_steps(self, where: str | None = None, params: Any = (), *, with_tokens: bool = True,
                   gate: bool = False, group_id: str | None = None, trajectory_id: str | None = None,
                   trajectory_ids: Iterable[str] | None = None,
                   rowids: tuple[int, int] | None = None) -> Iterator[dict]:
        """Exported steps in capture order; ``where`` is a SQL condition on the steps table (alias s),
        a user's (`--where`: ``BadInput`` when SQLite refuses it); ``group_id`` / ``trajectory_id`` keep
        one group's or one run's steps, ``trajectory_ids`` those of some runs (none when empty);
        ``rowids`` a shard of ``step_shards``. ``gate``: only what the curation gate lets through
        (see ``store/curation.py``)."""
        condition, params = step_selection(where, params, gate, group_id, trajectory_id, trajectory_ids, rowids)
        sql = ("SELECT s.*, t.reward AS trajectory_reward FROM steps s"
               f" LEFT JOIN trajectories t ON t.id = s.trajectory_id{condition} ORDER BY s.started_at, s.rowid")
        for row in user_rows(where, lambda: self.tx.db.query(sql, params)):
            yield self._export(row, with_tokens=with_tokens)

    def step_shards(self, rows: int, where: str | None = None, params: Any = (), *,
                    gate: bool = False) -> list[tuple[int, int]]:
        """The steps ``iter_steps`` selects, cut into rowid ranges of at most ``rows`` of them each
        (``iter_steps(..., rowids=shard)`` reads one), so that readers can share a file's steps."""
        if rows < 1:
            raise BadInput("a shard holds at least one step")
        condition, params = step_selection(where, params, gate, None, None, None, None)
        shards, first, count, last = [], None, 0, None
        for (rowid,) in user_rows(where, lambda: self.tx.db.execute(
                "SELECT s.rowid FROM steps s LEFT JOIN trajectories t ON t.id = s.trajectory_id"
                f"{condition} ORDER BY s.rowid", params)):
            first = rowid if first is None else first
            count, last = count + 1, rowid
            if count == rows:
                shards.append((first, last))
                first, count = None, 0
        if count:
            shards.append((first, last))
        return shards


def step_selection(where: str | None, params: Any, gate: bool, group_id: str | None, trajectory_id: str | None,
                   trajectory_ids: Iterable[str] | None, rowids: tuple[int, int] | None) -> tuple[str, Any]:
    """The WHERE clause (with its leading space, or empty) and parameters of a selection of steps: the
    caller's condition first, then ours, bound by name where the caller's parameters are named."""
    conditions = [f"({where})"] if where else []
    bound = UserParameters(params)
    bind = bound.bind
    for name, column, value in (("_group", "s.group_id =", group_id), ("_trajectory", "s.trajectory_id =", trajectory_id),
                                ("_from", "s.rowid >=", None if rowids is None else rowids[0]),
                                ("_to", "s.rowid <=", None if rowids is None else rowids[1])):
        if value is not None:
            conditions.append(f"{column} {bind(name, value)}")
    if trajectory_ids is not None:
        marks = [bind(f"_trajectory_{i}", value) for i, value in enumerate(trajectory_ids)]
        conditions.append(f"s.trajectory_id IN ({', '.join(marks)})")
    if gate:
        conditions.append(f"({curation.GATE_REASON}) IS NULL")
    return (" WHERE " + " AND ".join(conditions) if conditions else ""), bound.values
