"""The step store: one SQLite file, WAL mode, shared by the proxy, Datasette and the trainers.

``Store`` is composed of one part per job, each in its own module:

- ``connection.Transactions``: closing, write transactions, batches, WAL checkpoints
- ``state.State``: named values (the policy version, journal positions)
- ``blobs.Blobs``: request parameters and headers, stored once by hash
- ``trajectories.Trajectories``: trajectories and groups, registered runs, scoring fields
- ``steps.Steps``: recording and linking steps, and finding them
- ``token_ids.TokenIds``: token ids as deltas on the parent's, consistency, rebasing
- ``history.History``: conversations rebuilt from the deltas, with the LRU cache
- ``export.Export``: steps as exported records
- ``curation.Curation``: rewards, reviews and the gate
- ``stats.Stats``: counts
- ``consumption.Consumption``: trainers' claims and acks of groups
- ``reviewers.Reviewers``: the UI's named reviewers and their sign-in tokens
- ``training.Training``: training runs' numbers per policy version

``interface.StoreInterface`` lists what callers use of it (what another backend provides).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from stepmill.store.blobs import Blobs
from stepmill.store.connection import Transactions, open_database
from stepmill.store.consumption import Consumption
from stepmill.store.curation import Curation
from stepmill.store.export import Export
from stepmill.store.history import History, LRU
from stepmill.store.reviewers import Reviewers
from stepmill.store.state import State
from stepmill.store.stats import Stats
from stepmill.store.steps import Steps
from stepmill.store.token_ids import TokenIds
from stepmill.store.token_rows import TokenRow, TokenRows
from stepmill.store.trajectories import Trajectories
from stepmill.store.training import Training

__all__ = ["Store"]


class Store(Transactions, State, Blobs, Trajectories, Steps, TokenIds, History, Export, Curation, Stats,
            Consumption, Reviewers, Training):
    """Read and write step records. Safe to open from several processes at once."""

    def __init__(self, path: str, *, cache_size: int = 512, readonly: bool = False):
        """``readonly``: never write and never wait for the write lock (exports, stats, the UI)."""
        self.path = str(path)
        self.readonly = readonly
        self.db, self.schema_version = open_database(self.path, readonly=readonly)
        self._cache = LRU(cache_size)  # conversations, token ids and blobs already read
        self._batch: list | None = None  # inside batch(): cache entries to keep once it commits
        self._data_version = self.data_version()  # token ids cached before another process changed them go

    def token_rows(self, where: str | None = None, params: Any = (), *, gate: bool = True, group_id: str | None = None,
                   trajectory_ids: Iterable[str] | None = None) -> Iterator[TokenRow]:
        """The selected steps as trainers read them (``store/token_rows.py``): ids, logprobs, reward and
        place, no conversation rebuilt; through the curation gate unless ``gate`` is False."""
        return TokenRows(self).token_rows(where, params, gate=gate, group_id=group_id, trajectory_ids=trajectory_ids)
