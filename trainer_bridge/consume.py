"""The consumption stream: whole GRPO groups, each handed out once, recorded in the database.

A group is ready when it has ``n`` complete trajectories (and none still open) on the consumer's
channel (``train`` and ``val`` never mix). ``claim_many(k)`` leases up to ``k`` ready groups to this
consumer in one write transaction, so concurrent consumers never get the same group, and never
hands a consumer a group it holds already; ``ack_many`` marks them consumed together, in one
transaction (all or none: a group whose lease was lost makes it a ``Conflict`` naming it). A
consumer that dies before acknowledging gets nothing more, and its groups go back to the others
when their leases run out; a consumer that restarts under the same name first gets back its own
unacknowledged groups. A long optimizer step keeps its groups with ``renew()``. Groups whose steps
are older than ``max_staleness`` policy versions are set aside as ``stale`` and counted; every
claimed group's staleness is kept (``Store.consumption_staleness``).

    consumer = Consumer(Store("stepmill.db"), "trainer-0", n=8)
    for batch in consumer:                 # one group at a time; the next one acknowledges the one before
        train_on(batch.tensors)
    # or, several groups per optimizer step:
    with consumer.step(4) as batches:      # acknowledged together when the block ends, given back on an error
        optimizer_step(batches)            # call consumer.renew() during a step longer than the lease
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator

from stepmill.errors import ConfigError
from stepmill.store import Store
from stepmill.store.ids import new_id

from stepmill.trainer_bridge.layouts import Batch, group_batch


def group_ids(batches: Iterable[Batch]) -> list[str]:
    return [batch.meta["group_id"] for batch in batches]


class GroupStream:
    """What every consumer (this one, ``NodeConsumer`` over HTTP, a fleet's ``RemoteConsumer``) offers on
    top of its own ``claim_many``, ``ack_many`` and ``release_many``: one at a time, a step, iteration,
    each waiting up to ``wait_s`` for a group when none is ready (a trainer started before its rollout)."""

    wait_s: float = 0.0  # how long claim(), step() and iteration wait for a ready group (0: not at all)

    def not_ready(self) -> str | None:
        """What this consumer still lacks to claim at all (a node's write token, say), or None."""
        return None

    def claim_waiting(self, k: int) -> list[Batch]:
        """``claim_many(k)``, asked again every second while nothing is ready (or ``not_ready`` names
        what is missing), for up to ``wait_s``, with a progress line on stderr every 10 s. Past it: an
        empty list when nothing was ready, a ``ConfigError`` naming ``wait_s`` when something was missing."""
        waited = Waiting(self.wait_s, getattr(self, "name", "consumer"))
        while True:
            missing = self.not_ready()
            batches = [] if missing else self.claim_many(k)
            if batches or not waited.go_on(missing):
                return batches

    def claim(self) -> Batch | None:
        """The next ready group as one batch (leased to this consumer), or None when none is ready
        (within ``wait_s``)."""
        batches = self.claim_waiting(1)
        return batches[0] if batches else None

    def ack(self, batch: Batch) -> None:
        """Mark the batch's group consumed: ``Conflict`` when it is not leased to this consumer (its
        lease ran out and another took it, or it was acknowledged already), ``NotFound`` when nobody
        claimed it."""
        self.ack_many([batch])

    def release(self, batch: Batch) -> None:
        """Give the batch's group back unconsumed (another consumer may take it at once)."""
        self.release_many([batch])

    @contextmanager
    def step(self, k: int) -> Iterator[list[Batch]]:
        """Up to ``k`` batches for one optimizer step, acknowledged together when the block ends; given
        back when it raises."""
        with stepping(self, k) as batches:
            yield batches

    def __iter__(self) -> Iterator[Batch]:
        """Ready groups until none is left. Asking for the next one acknowledges the one before (a
        trainer that dies mid-batch never asks, and gets that group back when it restarts)."""
        return acknowledging(self)


class HeldGroups(GroupStream, ABC):
    """The groups one consumer session holds, by id, and what it did with them; where the acks, releases
    and renewals go is the subclass's (``_ack_groups``, ``_release_groups``, ``_renew_groups``)."""

    lease_seconds: float

    def __init__(self, session: str | None):
        self.session = session or new_id("session")
        self.report: Counter = Counter()
        self._acked: set = set()
        self.held: list[str] = []  # groups claimed and neither acknowledged nor given back, oldest first

    def ack_many(self, batches: Iterable[Batch]) -> None:
        """Mark the batches' groups consumed together, in one transaction: all of them, or none and a
        ``Conflict`` naming each group this consumer no longer holds."""
        groups = group_ids(batches)
        self._acked.update(groups)
        self._ack_groups(groups)
        self._forget(groups)
        self.report["groups acknowledged"] += len(groups)

    def release_many(self, batches: Iterable[Batch]) -> list[str]:
        """Give the batches' groups back unconsumed, at once; returns those this consumer still held."""
        groups = group_ids(batches)
        released = self._release_groups(groups)
        self._forget(groups)
        return released

    def renew(self, batches: Iterable[Batch] | None = None) -> list[str]:
        """Extend the leases of the batches' groups (None: every group held) to ``lease_seconds`` from
        now; returns those no longer held (their leases ran out and another consumer took them)."""
        groups = list(self.held) if batches is None else group_ids(batches)
        if not groups:
            return []
        lost = self._renew_groups(groups)
        if lost:
            self.report["leases lost while held"] += len(lost)
        return lost

    def _forget(self, groups: list[str]) -> None:
        done = set(groups)
        self.held = [group for group in self.held if group not in done]

    @abstractmethod
    def _ack_groups(self, groups: list[str]) -> None: ...

    @abstractmethod
    def _release_groups(self, groups: list[str]) -> list[str]: ...

    @abstractmethod
    def _renew_groups(self, groups: list[str]) -> list[str]: ...


class Consumer(HeldGroups):
    """The trainer's side of the stream; the leases, acks and staleness are the store's
    (``claim_groups``, ``ack_groups``, ``renew_groups``, ``release_groups``: ``store/consumption.py``).
    ``session``: this instance's id (new by default): the store never hands a session a group it
    holds, and a new session under the same name (a restarted trainer) takes up the name's groups."""

    def __init__(self, store: Store, name: str, *, n: int = 8, channel: str = "train", lease_seconds: float = 600,
                 max_staleness: int | None = None, session: str | None = None, scored: bool = False, **layout):
        super().__init__(session)
        self.store, self.name, self.n, self.channel, self.scored = store, name, n, channel, scored
        self.lease_seconds, self.max_staleness = lease_seconds, max_staleness
        self.layout = layout  # one batch per group

    def claim_many(self, k: int) -> list[Batch]:
        """Up to ``k`` groups, one batch each, leased to this consumer in one transaction (the groups
        this name held before a restart first); an empty list when none is ready."""
        claims = self.store.claim_groups(self.name, k, session=self.session, channel=self.channel, n=self.n,
                                         lease_seconds=self.lease_seconds, max_staleness=self.max_staleness,
                                         scored=self.scored)
        if claims.stale:
            self.report["groups set aside: stale"] += claims.stale
        self.held += claims.group_ids
        batches = []
        try:
            for group in claims.group_ids:
                batch = group_batch(self.store, group, **self.layout)
                # What the group gave, kept with its claim: an ack over HTTP carries no batch to count.
                self.store.set_group_rows(self.name, group, len(batch))
                batches.append(batch)
        except BaseException:  # batches the trainer never got: theirs to take at once, not after the lease
            self.store.release_groups(self.name, claims.group_ids, session=self.session)
            self._forget(list(claims.group_ids))
            raise
        return batches

    def _ack_groups(self, groups: list[str]) -> None:
        self.store.ack_groups(self.name, groups, session=self.session)

    def _release_groups(self, groups: list[str]) -> list[str]:
        return self.store.release_groups(self.name, groups, session=self.session)

    def _renew_groups(self, groups: list[str]) -> list[str]:
        return self.store.renew_groups(self.name, groups, session=self.session, lease_seconds=self.lease_seconds)


def staleness_summary(rows: Iterable[dict]) -> str | None:
    """One line on the groups handed out (``Store.consumption_staleness`` rows; those set aside as
    stale are not counted): how many, and how far behind the policy they were when claimed; None
    when no group was handed out."""
    rows = [row for row in rows if row["status"] != "stale"]
    counts = Counter(row["status"] for row in rows)
    if not counts:
        return None
    known = [row["staleness"] for row in rows if row["staleness"] is not None]
    behind = (f"mean {sum(known) / len(known):.2f}, max {max(known)} of {len(known)} with integer versions"
              if known else "unknown (policy versions not integers)")
    states = ", ".join(f"{counts[s]} {s}" for s in ("acked", "leased", "released") if counts[s])
    return f"groups handed out: {sum(counts.values())} ({states}); staleness at claim: {behind}"


class Waiting:
    """A consumer's wait for its first claimable group: how long it has waited, and what it says meanwhile."""

    POLL_S = 1.0
    PROGRESS_S = 10.0

    def __init__(self, wait_s: float, name: str):
        self.wait_s, self.name = wait_s, name
        self.start = self.said = time.monotonic()

    def go_on(self, missing: str | None) -> bool:
        """Whether to ask again (after a pause): False once ``wait_s`` is spent with nothing missing;
        ``ConfigError`` when it is spent and ``missing`` still names what is."""
        waited = time.monotonic() - self.start
        if waited >= self.wait_s:
            if missing:
                raise ConfigError(f"consumer {self.name!r} waited {self.wait_s:.0f} s (wait_s) and still lacks "
                                  f"{missing}")
            if self.wait_s:
                print(f"stepmill: consumer {self.name!r}: no group ready after {self.wait_s:.0f} s (wait_s)",
                      file=sys.stderr, flush=True)
            return False
        if time.monotonic() - self.said >= self.PROGRESS_S:
            self.said = time.monotonic()
            print(f"stepmill: consumer {self.name!r} waiting for {missing or 'a ready group'} "
                  f"({waited:.0f} s of {self.wait_s:.0f} s, wait_s)", file=sys.stderr, flush=True)
        time.sleep(min(self.POLL_S, self.wait_s - waited))
        return True


@contextmanager
def stepping(consumer, k: int) -> Iterator[list[Batch]]:
    """``consumer.claim_waiting(k)``, acknowledged together by ``ack_many`` after the block, or given back
    by ``release_many`` when it raises (the same for every consumer: local, over HTTP, of a fleet)."""
    batches = consumer.claim_waiting(k)
    try:
        yield batches
    except BaseException:
        if batches:
            consumer.release_many(batches)
        raise
    if batches:
        consumer.ack_many(batches)


def acknowledging(consumer) -> Iterator[Batch]:
    """Batches from ``consumer.claim()``, each acknowledged when the next is asked for (unless the
    caller acknowledged it already)."""
    previous = None
    while True:
        if previous is not None and previous.meta["group_id"] not in consumer._acked:
            consumer.ack(previous)
        batch = consumer.claim()
        if batch is None:
            return
        previous = batch
        yield batch
