"""What the rest of stepmill asks of a store: the methods another backend must provide.

The pipeline, the control API, the trainer bridge, rewards, the runner, the demo and the CLI call
these and nothing else (``Store.query`` and ``Store.db`` are SQLite's and stay inside store/).
``where`` arguments are conditions a user wrote (`--where "s.status = 'ok'"`), in SQL over the
named table alias; a backend applies them as given, and raises BadInput (``--where '…': why``)
for one it cannot run.

Errors, from ``stepmill.errors``: NotFound for an id that does not exist, Conflict for one taken,
BadInput for a value the store refuses, StoreUnavailable when the database cannot be opened or
written now (missing, too new, opened read-only; locked, busy, full, an I/O error): the writer
keeps its calls in the journal on that one and tries again.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from stepmill.store.consumption import Claim, Claims
    from stepmill.store.records import StepRecord


@runtime_checkable
class StoreInterface(Protocol):
    path: str
    readonly: bool
    schema_version: int

    # -- connection and transactions --------------------------------------------------------
    def close(self) -> None: ...

    def write(self) -> AbstractContextManager[Any]:
        """One write transaction; the calls made with ``in_transaction=True`` inside it join it."""

    def batch(self) -> AbstractContextManager[Any]:
        """One write transaction around many ``record_steps`` and ``set_state`` calls."""

    def data_version(self) -> int:
        """Changes whenever another connection commits."""

    def manage_checkpoints(self) -> None:
        """The writer process checkpoints itself from now on."""

    def checkpoint(self, mode: str) -> bool:
        """"PASSIVE" or "TRUNCATE"; False when a reader holds the log."""

    # -- state ----------------------------------------------------------------------------------
    def get_state(self, key: str, default: str | None = None) -> str | None: ...

    def set_state(self, key: str, value: str | None) -> None:
        """None removes the key; inside ``batch()`` it joins that transaction."""

    def journal_positions(self) -> dict[str, str]:
        """The committed position of every journal, by state key."""

    def policy_version(self) -> str | None: ...

    def set_policy_version(self, version: str | int | None, *, since: float | None = None) -> None: ...

    # -- trajectories, groups and registered runs -----------------------------------------------
    def trajectory(self, trajectory_id: str) -> dict | None: ...

    def start_trajectory(self, *, trajectory_id=None, group_id=None, channel=None, metadata=None) -> dict:
        """Conflict if the id is taken."""

    def update_trajectory(self, trajectory_id: str, *, group_id=None, channel=None, metadata=None) -> dict: ...

    def complete_trajectory(self, trajectory_id: str, *, reward: float | None = None) -> dict: ...

    def completed_trajectories(self, where: str | None = None, params: Any = (), *,
                               id_prefix: str | None = None, group_id: str | None = None) -> list[dict]:
        """Trajectory rows, oldest first, ``metadata`` decoded."""

    def trajectories_in_group(self, group_id: str) -> list[str]: ...

    def unsuccessful_runs(self) -> list[str]: ...

    def register_run(self, trajectory_id: str, secret_hash: str, *, door: str | None = None,
                     hosts: list | None = None) -> dict: ...

    def latest_run(self, trajectory_id: str) -> dict | None: ...

    def revoke_run(self, trajectory_id: str) -> dict | None: ...

    def registered_runs(self, after_rowid: int = 0) -> list[dict]: ...

    def run_readiness(self) -> list[dict]: ...

    def registered_at(self, trajectory_id: str) -> str | None: ...

    def set_scoring_fields(self, trajectory_id: str, fields: dict) -> None: ...

    def scoring_fields(self, trajectory_id: str) -> dict: ...

    # -- steps ----------------------------------------------------------------------------------
    def record_step(self, rec: StepRecord) -> str: ...

    def record_steps(self, records: list[StepRecord]) -> list[str]:
        """All of them or none."""

    def step_for_response(self, response_id: str) -> str | None: ...

    def trajectory_of_step(self, step_id: str) -> str | None: ...

    def last_step(self, trajectory_id: str) -> str | None: ...

    def step_ids(self, trajectory_id: str) -> list[str]: ...

    def step_summary(self, step_id: str) -> dict: ...

    # -- token ids ------------------------------------------------------------------------------
    def set_tokens(self, step_id: str, prompt_ids, response_ids, logprobs=None, *, provenance: str,
                   tokenizer: str | None = None, spliced_len: int | None = None, fidelity: str | None = None,
                   fidelity_detail: str | None = None, in_transaction: bool = False) -> None: ...

    def clear_tokens(self, step_id: str, *, tokenizer: str | None, fidelity: str | None,
                     fidelity_detail: str | None, in_transaction: bool = False) -> None: ...

    def token_sequences(self, step_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]: ...

    def steps_to_tokenize(self, where: str | None = None, params: Any = (), *, redo: bool = False) -> list[str]: ...

    def token_layout(self, step_id: str) -> dict: ...

    # -- history --------------------------------------------------------------------------------
    def continuation(self, step_id: str) -> tuple[list[dict], list]: ...

    def messages(self, step_id: str) -> list[dict]: ...

    def wire_messages(self, step_id: str) -> list: ...

    # -- export ---------------------------------------------------------------------------------
    def step(self, step_id: str, *, with_tokens: bool = True) -> dict: ...

    def iter_steps(self, where: str | None = None, params: Any = (), *, with_tokens: bool = True,
                   gate: bool = False, group_id: str | None = None, trajectory_id: str | None = None,
                   trajectory_ids: Iterable[str] | None = None,
                   rowids: tuple[int, int] | None = None) -> Iterator[dict]:
        """``trajectory_ids``: only those runs' steps (none for an empty list)."""

    def step_shards(self, rows: int, where: str | None = None, params: Any = (), *,
                    gate: bool = False) -> list[tuple[int, int]]: ...

    # -- curation -------------------------------------------------------------------------------
    def add_reward(self, target: str, value: float, *, source: str = "api", name: str | None = None,
                   note: str | None = None, details: Any = None, idempotency_key: str | None = None) -> dict: ...

    def add_trajectory_rewards(self, results: list[tuple[str, float | None, Any]], *, source: str,
                               name: str) -> None: ...

    def rewarded_trajectories(self, name: str) -> set[str]: ...

    def add_review(self, target: str, action: str, value: str | None = None, *, reviewer: str) -> dict: ...

    def curation(self, target: str) -> dict: ...

    def gate_counts(self, where: str | None = None, params: Any = ()) -> dict: ...

    # -- consumption ----------------------------------------------------------------------------
    def claim_group(self, consumer: str, *, channel: str = "train", n: int = 8, lease_seconds: float = 600,
                    max_staleness: int | None = None, now: float | None = None) -> Claim: ...

    def set_group_rows(self, consumer: str, group_id: str, rows: int) -> None:
        """The row count of the batch made of a group the consumer holds (the ack's, unless it gives one)."""

    def ack_group(self, consumer: str, group_id: str, *, rows: int | None = None) -> None:
        """``rows`` None keeps what ``set_group_rows`` recorded."""

    def claim_groups(self, consumer: str, k: int = 1, *, session: str | None = None, channel: str = "train",
                     n: int = 8, lease_seconds: float = 600, max_staleness: int | None = None,
                     scored: bool = False, now: float | None = None) -> Claims:
        """Up to ``k`` groups in one transaction: the name's groups held under another session first (a
        restart), never one the session holds; staleness kept with each."""

    def ack_groups(self, consumer: str, group_ids: Iterable[str], *, session: str | None = None,
                   rows: Mapping[str, int] | None = None) -> None:
        """All in one transaction or none: ``Conflict`` naming each group no longer held."""

    def release_groups(self, consumer: str, group_ids: Iterable[str], *, session: str | None = None) -> list[str]:
        """Those held given back, ready at once; returns them."""

    def renew_groups(self, consumer: str, group_ids: Iterable[str], *, session: str | None = None,
                     lease_seconds: float = 600, now: float | None = None) -> list[str]:
        """Leases of the groups held extended; returns the groups no longer held."""

    def consumption_staleness(self, *, channel: str | None = None, consumer: str | None = None) -> list[dict]:
        """One row per group handed out or set aside: consumer, status, staleness, policy versions."""

    # -- reviewers ------------------------------------------------------------------------------
    def create_reviewer(self, name: str) -> str:
        """A new sign-in token for ``name`` (replacing any earlier one); only its hash is kept."""

    def reviewer_for_token(self, token: str) -> str | None: ...

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> dict: ...

    def rollout_totals(self, id_prefix: str) -> dict: ...

    def steps_by_agent(self) -> list[dict]: ...

    def rewards_by_agent(self) -> list[dict]: ...

    def group_reward_ranges(self) -> list[dict]: ...

    # -- training -------------------------------------------------------------------------------
    def record_train_metrics(self, run: str, version: int, metrics: dict) -> None:
        """A training run's numbers for one policy version (finite numbers or None)."""

    def train_metrics(self, run: str | None = None) -> list[dict]:
        """One row per run and version: ``{"run", "version", <name>: value, …}``."""

    def train_runs(self) -> list[str]: ...

    def mean_trajectory_reward(self, id_prefix: str) -> float | None: ...
