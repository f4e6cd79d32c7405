"""The consumption stream: whole GRPO groups, each handed out once, recorded in the database.

A group is ready when it has ``n`` complete trajectories (and none still open) on the consumer's
channel (``train`` and ``val`` never mix). ``claim`` leases the next ready group to a consumer in
one write transaction, so concurrent consumers never get the same group; ``ack`` marks it
consumed. A consumer that dies before acknowledging gets nothing more, and its group goes back to
the others when the lease runs out; a consumer that restarts under the same name first gets back
its own unacknowledged groups. Groups whose steps are older than ``max_staleness`` policy versions
are set aside as ``stale`` and counted.

    consumer = Consumer(Store("stepmill.db"), "trainer-0", n=8)
    for batch in consumer:                 # the next one acknowledges the one before
        train_on(batch.tensors)
    # or: batch = consumer.claim(); …; consumer.ack(batch)
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from stepmill.store import Store

from stepmill.trainer_bridge.layouts import Batch, group_batch


class Consumer:
    """The trainer's side of the stream; the leases, acks and staleness are the store's
    (``claim_group`` and ``ack_group``, see ``store/consumption.py``)."""

    def __init__(self, store: Store, name: str, *, n: int = 8, channel: str = "train", lease_seconds: float = 600,
                 max_staleness: int | None = None, **layout):
        self.store, self.name, self.n, self.channel = store, name, n, channel
        self.lease_seconds, self.max_staleness = lease_seconds, max_staleness
        self.layout = layout  # one batch per group
        self.report: Counter = Counter()
        self._acked: set = set()

    def claim(self) -> Batch | None:
        """The next ready group as one batch (leased to this consumer), or None when none is ready."""
        claim = self.store.claim_group(self.name, channel=self.channel, n=self.n, lease_seconds=self.lease_seconds,
                                       max_staleness=self.max_staleness)
        if claim.stale:
            self.report["groups set aside: stale"] += claim.stale
        if claim.group_id is None:
            return None
        batch = group_batch(self.store, claim.group_id, **self.layout)
        # What the group gave, kept with its claim: an ack over HTTP carries no batch to count.
        self.store.set_group_rows(self.name, claim.group_id, len(batch))
        return batch

    def ack(self, batch: Batch) -> None:
        """Mark the batch's group consumed: ``Conflict`` when it is not leased to this consumer (its
        lease ran out and another took it, or it was acknowledged already), ``NotFound`` when nobody
        claimed it."""
        group = batch.meta["group_id"]
        self._acked.add(group)
        self.store.ack_group(self.name, group)

    def __iter__(self) -> Iterator[Batch]:
        """Ready groups until none is left. Asking for the next one acknowledges the one before (a
        trainer that dies mid-batch never asks, and gets that group back when it restarts)."""
        return acknowledging(self)


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
