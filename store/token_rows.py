"""Token rows: what a trainer's batch needs of each step, read straight from the stored id deltas.

A step's prompt ids are stored as a delta on its parent's prompt + response ids (``sequences.py``,
``token_ids.py``). A trainer needs the ids, the logprobs, the reward and the step's place (trajectory,
group, index, policy version), never the conversation: ``TokenRows.token_rows`` reads the selected
steps' deltas and those of the ancestors they continue in one statement (one snapshot), then rebuilds
each step's ids by concatenation. The ids are the stored ones, never re-encoded, and each row keeps its
step's ``token_provenance``. A rebuilt sequence is kept only until the last step that continues it
has been read, so memory follows the deltas, not the rebuilt prompts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from stepmill.store.connection import Transactions
from stepmill.store.export import step_selection
from stepmill.store.sequences import ID_DTYPE, unpack_ids, unpack_logprobs
from stepmill.store.sql_errors import user_condition

if TYPE_CHECKING:  # numpy loads where ids are read: the proxy's writer never needs it for this
    import numpy as np

# One statement, so one snapshot of the file: the selected steps in capture order, after the steps they
# continue that the selection left out (gated out, another --where) and those these continue in turn.
# The walk up stops at a step that shares nothing with its parent, as ``History._chain``'s does.
_TOKEN_ROWS = """
    WITH RECURSIVE selected AS MATERIALIZED (
        SELECT s.id, s.parent_step_id, s.prompt_len, s.prompt_base_len, s.prompt_suffix, s.response_ids,
               s.trajectory_id, s.group_id, s.step_index, s.policy_version, coalesce(s.reward, t.reward) AS reward,
               s.token_provenance, s.logprobs, s.started_at, s.rowid AS position
        FROM steps s LEFT JOIN trajectories t ON t.id = s.trajectory_id{condition}
    ),
    left_out(id) AS (
        SELECT parent_step_id FROM selected
        WHERE coalesce(prompt_base_len, 0) > 0 AND parent_step_id NOT IN (SELECT id FROM selected)
        UNION
        SELECT s.parent_step_id FROM steps s JOIN left_out ON s.id = left_out.id
        WHERE coalesce(s.prompt_base_len, 0) > 0 AND s.parent_step_id NOT IN (SELECT id FROM selected)
    )
    SELECT 0, s.id, s.parent_step_id, s.prompt_len, s.prompt_base_len, s.prompt_suffix, s.response_ids,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM steps s WHERE s.id IN (SELECT id FROM left_out)
    UNION ALL
    SELECT 1, * FROM selected
    ORDER BY 1, 15, 16"""


@dataclass(slots=True)
class TokenRow:
    """One step as a trainer reads it. ``prompt_ids`` / ``response_ids`` are int32 (as stored), None
    when the step has no ids (`stepmill tokenize` first); ``logprobs`` float32, one per response id,
    None when the engine gave none; ``reward`` the effective one (the step's, else its trajectory's)."""

    step_id: str
    trajectory_id: str | None
    group_id: str | None
    parent_step_id: str | None
    step_index: int | None
    policy_version: str | None
    reward: float | None
    provenance: str  # exact | rendered | spliced | none: where every id of this row came from
    prompt_ids: np.ndarray | None
    response_ids: np.ndarray | None
    logprobs: np.ndarray | None

    @property
    def has_ids(self) -> bool:
        return self.prompt_ids is not None and self.response_ids is not None

    def ids(self) -> np.ndarray:
        """Prompt then response: the sequence the policy saw and sampled."""
        import numpy as np

        return np.concatenate([self.prompt_ids, self.response_ids])

    def loss_mask(self) -> np.ndarray:
        """0 on the prompt, 1 on every sampled (response) id."""
        import numpy as np

        return np.repeat(np.array([0, 1], dtype=np.int8), [len(self.prompt_ids), len(self.response_ids)])


class TokenRows:
    """Steps as trainers read them; a part of ``Store`` over its connection."""

    def __init__(self, tx: Transactions):
        self.tx = tx

    def token_rows(self, where: str | None = None, params: Any = (), *, gate: bool = True,
                   group_id: str | None = None, trajectory_ids: Iterable[str] | None = None) -> Iterator[TokenRow]:
        """The selected steps as ``TokenRow``s in capture order (``Export.iter_steps``'s selection and
        order: ``where`` a user's condition on ``steps s``, ``BadInput`` when SQLite refuses it; ``gate``:
        only what the curation gate lets through, as trainers read)."""
        condition, values = step_selection(where, params, gate, group_id, None, trajectory_ids, None)
        with user_condition(where):
            rows = self.tx.conn.execute(_TOKEN_ROWS.format(condition=condition), values).fetchall()
        deltas = {row[1]: row[2:7] for row in rows}
        selected = [row[1:14] for row in rows if row[0]]
        sequences = _Sequences(deltas, [row[0] for row in selected if row[2] is not None])
        for (step_id, parent, prompt_len, _base, _suffix, _response, trajectory_id, group, step_index, version,
             reward, provenance, logprobs) in selected:
            prompt = response = None
            if prompt_len is not None:
                full = sequences.take(step_id)
                prompt, response = full[:prompt_len], full[prompt_len:]
            yield TokenRow(step_id, trajectory_id, group, parent, step_index, version, reward, provenance or "none",
                           prompt, response, None if prompt is None else unpack_logprobs(logprobs))


class _Sequences:
    """Steps' prompt + response ids rebuilt from their deltas (id -> parent, prompt_len, base_len,
    suffix, response ids). Each is kept while someone still waits for it: a step that continues it,
    or its own row (``reads``), so nothing is rebuilt twice and nothing is kept longer than needed."""

    def __init__(self, deltas: dict[str, tuple], reads: Iterable[str]):
        self.deltas = deltas
        self.waiting = Counter(parent for parent, _, base_len, _, _ in deltas.values() if base_len)
        self.waiting.update(reads)
        self.kept: dict[str, np.ndarray] = {}

    def take(self, step_id: str) -> np.ndarray:
        """The step's prompt + response ids for one who waits for them (read-only: others are rebuilt on them)."""
        full = self.kept.get(step_id)
        if full is None:
            full = self._build(step_id)
        self.waiting[step_id] -= 1
        if self.waiting[step_id] <= 0:
            self.kept.pop(step_id, None)
        return full

    def _build(self, step_id: str) -> np.ndarray:
        import numpy as np

        path = [step_id]  # up to a step that continues nothing, or one whose parent is kept
        while True:
            parent, _, base_len, _, _ = self.deltas[path[-1]]
            if not base_len or parent in self.kept:
                break
            path.append(parent)
        for node in reversed(path):
            parent, _, base_len, suffix, response = self.deltas[node]
            base = self.take(parent)[:base_len] if base_len else np.zeros(0, ID_DTYPE)
            full = np.concatenate([base, unpack_ids(suffix), unpack_ids(response)])
            full.flags.writeable = False
            if self.waiting[node] > 0:
                self.kept[node] = full
        return full
