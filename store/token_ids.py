"""Token ids of steps: stored as deltas on the parent's, checked for consistency, rebased when re-set.

A child's prompt ids are stored against its parent's prompt + response ids; whether they continue
them (``consistency``) is decided at write time. Ids set later (`stepmill tokenize`) rebase the
children stored against the old ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stepmill.errors import BadInput, NotFound
from stepmill.store.connection import Transactions
from stepmill.store.history import History
from stepmill.store.sequences import pack_ids, pack_logprobs, split_against, unpack_ids, unpack_logprobs
from stepmill.store.sql_errors import user_condition

if TYPE_CHECKING:
    import numpy as np

# Steps `stepmill tokenize` renders when no condition is given: captured without ids, with an answer.
UNTOKENIZED = "s.token_provenance = 'none' AND s.completion IS NOT NULL"
# With ``redo``: rendered or spliced ones again too. Engine-sampled (exact) ids are never replaced.
RETOKENIZABLE = "s.token_provenance IN ('none', 'rendered', 'spliced') AND s.completion IS NOT NULL"


class TokenIds:
    """Set, clear and read steps' token ids, rebuilt over ``History.chain`` through ``tx.cache``."""

    def __init__(self, tx: Transactions, history: History):
        self.tx = tx
        self.history = history
        self._data_version = tx.data_version()  # token ids cached before another process changed them go

    def token_columns(self, parent_id, prompt_ids, response_ids, logprobs, provenance, *, spliced_len=None,
                       system_changed: bool = False) -> dict:
        if prompt_ids is None and response_ids is None:
            return {}
        import numpy as np

        prompt = np.asarray(prompt_ids if prompt_ids is not None else [], dtype=np.int64)
        response = np.asarray(response_ids if response_ids is not None else [], dtype=np.int64)
        if logprobs is not None and len(logprobs) != len(response):
            raise BadInput(f"logprobs has {len(logprobs)} values for {len(response)} response ids")
        base = self._continued(parent_id)
        base_len, suffix = split_against(prompt, base)
        if base is None or not len(base):
            consistency, pos, reason = ("root" if parent_id is None else None), None, None
        elif base_len == len(base):
            consistency, pos, reason = "consistent", None, None
        else:
            consistency, pos = "divergent", base_len
            if base_len == len(prompt):
                reason = f"prompt ends at {len(prompt)} inside the parent's {len(base)} prompt+response ids"
            else:
                reason = (f"token {base_len}: parent sequence has id {int(base[base_len])}, "
                          f"this prompt has id {int(prompt[base_len])}")
            if system_changed:
                reason += " (the system prompt changed since the parent step)"
        return {
            "token_provenance": provenance,
            "prompt_len": len(prompt),
            "prompt_base_len": base_len,
            "prompt_suffix": pack_ids(suffix),
            "response_len": len(response),
            "response_ids": pack_ids(response),
            "logprobs": pack_logprobs(logprobs),
            "spliced_len": spliced_len,
            "consistency": consistency,
            "divergence_pos": pos,
            "divergence_reason": reason,
        }

    def set_tokens(self, step_id: str, prompt_ids, response_ids, logprobs=None, *, provenance: str,
                   tokenizer: str | None = None, spliced_len: int | None = None, fidelity: str | None = None,
                   fidelity_detail: str | None = None, in_transaction: bool = False) -> None:
        """Store ids computed after capture (rendered, spliced); the parent's must already be stored."""
        row = self.tx.conn.execute("SELECT parent_step_id, system_changed FROM steps WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise NotFound(step_id)
        cols = self.token_columns(row[0], prompt_ids, response_ids, logprobs, provenance, spliced_len=spliced_len,
                                  system_changed=bool(row[1]))
        cols.update({"tokenizer": tokenizer, "fidelity": fidelity, "fidelity_detail": fidelity_detail})
        if in_transaction:
            self._update_tokens(step_id, cols)
        else:
            with self.tx.write():
                self._update_tokens(step_id, cols)

    def clear_tokens(self, step_id: str, *, tokenizer: str | None, fidelity: str | None,
                     fidelity_detail: str | None, in_transaction: bool = False) -> None:
        """Remove a step's ids (rendering failed): it has none rather than ids of another tokenizer."""
        cols = {"token_provenance": "none", "prompt_len": None, "prompt_base_len": None, "prompt_suffix": None,
                "response_len": None, "response_ids": None, "logprobs": None, "spliced_len": None,
                "consistency": None, "divergence_pos": None, "divergence_reason": None,
                "tokenizer": tokenizer, "fidelity": fidelity, "fidelity_detail": fidelity_detail}
        if self.tx.conn.execute("SELECT 1 FROM steps WHERE id = ?", [step_id]).fetchone() is None:
            raise NotFound(step_id)
        if in_transaction:
            self._update_tokens(step_id, cols)
        else:
            with self.tx.write():
                self._update_tokens(step_id, cols)

    def _update_columns(self, step_id: str, cols: dict) -> None:
        self.tx.conn.execute(f"UPDATE steps SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?",
                             [*cols.values(), step_id])

    def _update_tokens(self, step_id: str, cols: dict) -> None:
        conn = self.tx.conn
        # Children store their prompt as a delta against this step's ids: rebase them on the new ids, and
        # check again those stored before this step had ids (their consistency was unknown).
        children = {
            child: self.token_sequences(child) for (child,) in conn.execute(
                "SELECT id FROM steps WHERE parent_step_id = ? AND prompt_len IS NOT NULL", [step_id]).fetchall()
        }
        self._update_columns(step_id, cols)
        self.tx.cache.pop(("tokens", step_id), None)
        for child, (prompt, response, logprobs) in children.items():
            provenance, spliced, changed = conn.execute(
                "SELECT token_provenance, spliced_len, system_changed FROM steps WHERE id = ?", [child]).fetchone()
            rebased = self.token_columns(step_id, prompt, response, logprobs, provenance, spliced_len=spliced,
                                         system_changed=bool(changed))
            self._update_columns(child, rebased)
            self.tx.cache.pop(("tokens", child), None)

    def _forget_changed_tokens(self) -> None:
        """Token ids can be re-set (`stepmill tokenize --redo`) by another process: when the file changed
        under us, cached token sequences may be stale. Conversations never change once written."""
        version = self.tx.data_version()
        if version != self._data_version:
            self._data_version = version
            for key in [k for k in self.tx.cache if k[0] == "tokens"]:
                del self.tx.cache[key]

    def _continued(self, step_id: str | None) -> np.ndarray | None:
        """What a child of ``step_id`` continues: its prompt + response ids (None when it has none)."""
        if step_id is None:
            return None
        self._forget_changed_tokens()
        key = ("tokens", step_id)
        if key in self.tx.cache:
            return self.tx.cache[key]
        import numpy as np

        prompt, response, _ = self.token_sequences(step_id)
        value = np.concatenate([prompt, response]) if len(prompt) or len(response) else None
        self.tx.cache.put(key, value)
        return value

    def token_sequences(self, step_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(prompt_ids, response_ids, logprobs) of one step, rebuilt from the shared prefixes."""
        import numpy as np

        self._forget_changed_tokens()
        full, rows = self.history.chain("tokens", step_id, "prompt_base_len", "prompt_suffix", "response_ids",
                                        "logprobs", "prompt_len")
        target = rows[-1]
        if target["prompt_len"] is None:
            return np.zeros(0, np.int32), np.zeros(0, np.int32), None
        full = full if full is not None else np.zeros(0, np.int32)
        for row in rows:
            prompt = np.concatenate([full[: row["prompt_base_len"] or 0], unpack_ids(row["prompt_suffix"])])
            response = unpack_ids(row["response_ids"])
            full = np.concatenate([prompt, response])
        self.tx.cache.put(("tokens", step_id), full)
        return prompt, response, unpack_logprobs(target["logprobs"])

    def steps_to_tokenize(self, where: str | None = None, params: Any = (), *, redo: bool = False) -> list[str]:
        """Ids of the steps to render, parents before children (capture order). ``where``: a user's
        SQL condition on the steps table (alias s); steps with exact ids are never among them."""
        condition = where or (RETOKENIZABLE if redo else UNTOKENIZED)
        with user_condition(where):
            return [row[0] for row in self.tx.conn.execute(
                # The user's condition is parenthesised: an OR in it can never reach engine-sampled (exact) ids.
                f"SELECT s.id FROM steps s WHERE ({condition}) AND s.token_provenance != 'exact'"
                " ORDER BY s.started_at, s.rowid", params)]

    def token_layout(self, step_id: str) -> dict:
        """Where a step's ids come from (``token_provenance``), how many messages it was prompted with
        (``message_count``) and how many of them continue its parent's history (``messages_base_len``)."""
        row = self.tx.conn.execute("SELECT token_provenance, message_count, messages_base_len FROM steps"
                                   " WHERE id = ?", [step_id]).fetchone()
        if row is None:
            raise NotFound(step_id)
        return {"token_provenance": row[0], "message_count": row[1], "messages_base_len": row[2]}
