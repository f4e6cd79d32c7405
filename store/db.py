"""The step store: one SQLite file, WAL mode, shared by the proxy, Datasette and the trainers.

``Store`` opens the file and builds one part per job over its one connection, each a plain class
given, as constructor arguments, the connection and the other parts it uses:

- ``transactions`` (``connection.Transactions``): the connection, write transactions, batches,
  WAL checkpoints, and the LRU cache of what the parts read (``cache.LRU``)
- ``state`` (``state.State``): named values (the policy version, journal positions)
- ``entries`` (``entries.JournalEntries``): the journal entries committed, by identity (each exactly once)
- ``blobs`` (``blobs.Blobs``): request parameters and headers, stored once by hash
- ``history`` (``history.History``): conversations rebuilt from the deltas
- ``token_ids`` (``token_ids.TokenIds``; history): token ids as deltas on the parent's, consistency, rebasing
- ``steps`` (``steps.Steps``; blobs, history, token_ids): recording and linking steps, and finding them
- ``trajectories`` (``trajectories.Trajectories``; state): trajectories and groups, scoring fields
- ``runs`` (``runs.Runs``): the runner's registered runs, their secrets' hashes and doors
- ``export`` (``export.Export``; blobs, history, token_ids): steps as exported records
- ``rewards_and_reviews`` (``curation.Curation``): rewards, reviews and the gate
- ``counts`` (``counts.Counts``; state): counts over the file and a rollout's runs
- ``consumption`` (``consumption.Consumption``; state): trainers' claims and acks of groups
- ``reviewers`` (``reviewers.Reviewers``): the UI's named reviewers and their sign-in tokens
- ``training`` (``training.Training``): training runs' numbers per policy version
- ``rows`` (``token_rows.TokenRows``): steps as trainers read them (ids, logprobs, reward, place)
- ``search`` (``search.SearchIndex``): the full-text index, filled after the steps' commit

The UI's page queries are ``views``' functions of a ``Store``; the schema is ``migrations``'.

What the rest of stepmill calls is ``Store``'s public surface below: one ``forward`` per method,
to the part that does it (``Store.query`` and ``Store.db`` are SQLite's and stay inside store/ and
its tests). ``where`` arguments are conditions a user wrote (`--where "s.status = 'ok'"`), in SQL
over the named table alias, applied as given; one SQLite refuses is BadInput (``--where '…': why``).
Errors, from ``stepmill.errors``: NotFound for an id that does not exist, Conflict for one taken,
BadInput for a value the store refuses, StoreUnavailable when the database cannot be opened or
written now (missing, too new, opened read-only; locked, busy, full, an I/O error): the writer
keeps its calls in the journal on that one and tries again.
"""

from __future__ import annotations

from typing import Any, Callable

from stepmill.store.blobs import Blobs
from stepmill.store.cache import LRU
from stepmill.store.connection import Transactions, open_database
from stepmill.store.consumption import Consumption
from stepmill.store.counts import Counts
from stepmill.store.curation import Curation
from stepmill.store.entries import JournalEntries
from stepmill.store.export import Export
from stepmill.store.history import History
from stepmill.store.reviewers import Reviewers
from stepmill.store.runs import Runs
from stepmill.store.search import SearchIndex
from stepmill.store.state import State
from stepmill.store.steps import Steps
from stepmill.store.token_ids import TokenIds
from stepmill.store.token_rows import TokenRows
from stepmill.store.trajectories import Trajectories
from stepmill.store.training import Training

__all__ = ["Store"]


class forward:  # noqa: N801 - used as a declaration in the class body, like property
    """``Store.<name>(...)`` is ``store.<part>.<name>(...)``: a method of a part kept where callers
    call it. On the class it is the part's function (its signature and docstring)."""

    def __init__(self, part: str, method: Callable[..., Any]):
        self.part = part
        self.method = method
        self.name = method.__name__
        self.__doc__ = method.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.name:
            raise TypeError(f"{owner.__name__}.{name} forwards to {self.part}.{self.name}: the names differ")

    def __get__(self, store: Any, owner: type | None = None) -> Any:
        if store is None:
            return self.method
        return getattr(getattr(store, self.part), self.name)


class Store:
    """Read and write step records. Safe to open from several processes at once."""

    def __init__(self, path: str, *, cache_size: int = 512, readonly: bool = False):
        """``readonly``: never write and never wait for the write lock (exports, stats, the UI)."""
        self.path = str(path)
        self.readonly = readonly
        self.db, self.schema_version = open_database(self.path, readonly=readonly)
        # conversations, token ids and blobs already read, shared by the parts that read them
        cache = LRU(cache_size)
        self.transactions = tx = Transactions(self.db, path=self.path, readonly=readonly, cache=cache)
        self.state = State(tx)
        self.entries = JournalEntries(tx)
        self.blobs = Blobs(tx)
        self.history = History(tx)
        self.token_ids = TokenIds(tx, self.history)
        self.steps = Steps(tx, self.blobs, self.history, self.token_ids)
        self.trajectories = Trajectories(tx, self.state)
        self.runs = Runs(tx)
        self.export = Export(tx, self.blobs, self.history, self.token_ids)
        self.rewards_and_reviews = Curation(tx)
        self.counts = Counts(tx, self.state)
        self.consumption = Consumption(tx, self.state)
        self.reviewers = Reviewers(tx)
        self.training = Training(tx)
        self.rows = TokenRows(tx)
        self.search = SearchIndex(tx)

    # -- connection and transactions ------------------------------------------------------------
    close = forward("transactions", Transactions.close)
    write = forward("transactions", Transactions.write)
    batch = forward("transactions", Transactions.batch)
    query = forward("transactions", Transactions.query)
    data_version = forward("transactions", Transactions.data_version)
    manage_checkpoints = forward("transactions", Transactions.manage_checkpoints)
    checkpoint = forward("transactions", Transactions.checkpoint)

    # -- state ----------------------------------------------------------------------------------
    get_state = forward("state", State.get_state)
    set_state = forward("state", State.set_state)
    journal_positions = forward("state", State.journal_positions)
    policy_version = forward("state", State.policy_version)
    set_policy_version = forward("state", State.set_policy_version)
    policy_version_at = forward("state", State.policy_version_at)
    policy_versions_at = forward("state", State.policy_versions_at)

    # -- journal entries committed --------------------------------------------------------------
    journal_entry = forward("entries", JournalEntries.journal_entry)
    forget_journal = forward("entries", JournalEntries.forget_journal)

    # -- trajectories and groups ----------------------------------------------------------------
    trajectory = forward("trajectories", Trajectories.trajectory)
    start_trajectory = forward("trajectories", Trajectories.start_trajectory)
    update_trajectory = forward("trajectories", Trajectories.update_trajectory)
    complete_trajectory = forward("trajectories", Trajectories.complete_trajectory)
    completed_trajectories = forward("trajectories", Trajectories.completed_trajectories)
    trajectories_in_group = forward("trajectories", Trajectories.trajectories_in_group)
    unsuccessful_runs = forward("trajectories", Trajectories.unsuccessful_runs)
    set_scoring_fields = forward("trajectories", Trajectories.set_scoring_fields)
    scoring_fields = forward("trajectories", Trajectories.scoring_fields)

    # -- registered runs ------------------------------------------------------------------------
    register_run = forward("runs", Runs.register_run)
    latest_run = forward("runs", Runs.latest_run)
    revoke_run = forward("runs", Runs.revoke_run)
    registered_runs = forward("runs", Runs.registered_runs)
    run_readiness = forward("runs", Runs.run_readiness)
    registered_at = forward("runs", Runs.registered_at)

    # -- steps ----------------------------------------------------------------------------------
    record_step = forward("steps", Steps.record_step)
    record_steps = forward("steps", Steps.record_steps)
    step_for_response = forward("steps", Steps.step_for_response)
    trajectory_of_step = forward("steps", Steps.trajectory_of_step)
    last_step = forward("steps", Steps.last_step)
    step_ids = forward("steps", Steps.step_ids)
    step_summary = forward("steps", Steps.step_summary)

    # -- token ids ------------------------------------------------------------------------------
    set_tokens = forward("token_ids", TokenIds.set_tokens)
    clear_tokens = forward("token_ids", TokenIds.clear_tokens)
    token_sequences = forward("token_ids", TokenIds.token_sequences)
    steps_to_tokenize = forward("token_ids", TokenIds.steps_to_tokenize)
    token_layout = forward("token_ids", TokenIds.token_layout)

    # -- history --------------------------------------------------------------------------------
    continuation = forward("history", History.continuation)
    messages = forward("history", History.messages)
    wire_messages = forward("history", History.wire_messages)

    # -- token rows (what trainers read of steps) ------------------------------------------------
    token_rows = forward("rows", TokenRows.token_rows)

    # -- the full-text index ---------------------------------------------------------------------
    index_search = forward("search", SearchIndex.index_search)
    search_behind = forward("search", SearchIndex.search_behind)

    # -- export ---------------------------------------------------------------------------------
    step = forward("export", Export.step)
    iter_steps = forward("export", Export.iter_steps)
    step_shards = forward("export", Export.step_shards)

    # -- curation -------------------------------------------------------------------------------
    add_reward = forward("rewards_and_reviews", Curation.add_reward)
    add_trajectory_rewards = forward("rewards_and_reviews", Curation.add_trajectory_rewards)
    rewarded_trajectories = forward("rewards_and_reviews", Curation.rewarded_trajectories)
    add_review = forward("rewards_and_reviews", Curation.add_review)
    curation = forward("rewards_and_reviews", Curation.curation)
    gate_counts = forward("rewards_and_reviews", Curation.gate_counts)

    # -- consumption ----------------------------------------------------------------------------
    claim_group = forward("consumption", Consumption.claim_group)
    claim_groups = forward("consumption", Consumption.claim_groups)
    set_group_rows = forward("consumption", Consumption.set_group_rows)
    ack_group = forward("consumption", Consumption.ack_group)
    ack_groups = forward("consumption", Consumption.ack_groups)
    release_groups = forward("consumption", Consumption.release_groups)
    renew_groups = forward("consumption", Consumption.renew_groups)
    consumption_staleness = forward("consumption", Consumption.consumption_staleness)

    # -- reviewers ------------------------------------------------------------------------------
    create_reviewer = forward("reviewers", Reviewers.create_reviewer)
    reviewer_for_token = forward("reviewers", Reviewers.reviewer_for_token)

    # -- counts ---------------------------------------------------------------------------------
    stats = forward("counts", Counts.stats)
    rollout_totals = forward("counts", Counts.rollout_totals)
    steps_by_agent = forward("counts", Counts.steps_by_agent)
    rewards_by_agent = forward("counts", Counts.rewards_by_agent)
    group_reward_ranges = forward("counts", Counts.group_reward_ranges)
    mean_trajectory_reward = forward("counts", Counts.mean_trajectory_reward)

    # -- training -------------------------------------------------------------------------------
    record_train_metrics = forward("training", Training.record_train_metrics)
    train_metrics = forward("training", Training.train_metrics)
    train_runs = forward("training", Training.train_runs)
