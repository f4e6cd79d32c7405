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

import time
from collections import Counter
from typing import Iterator

from stepmill.store.db import Store, now_iso

from stepmill.trainer_bridge.layouts import Batch, step_batches

READY = """
SELECT t.group_id, min(t.policy_version) AS oldest
FROM trajectories t
WHERE t.channel = :channel AND t.group_id IS NOT NULL
GROUP BY t.group_id
HAVING sum(t.status = 'complete') >= :n AND sum(t.status != 'complete') = 0
   AND t.group_id NOT IN (SELECT group_id FROM consumption WHERE status IN ('acked', 'stale')
                          OR (status = 'leased' AND lease_until > :now))
ORDER BY min(t.created_at)
LIMIT 50
"""


class Consumer:
    def __init__(self, store: Store, name: str, *, n: int = 8, channel: str = "train", lease_seconds: float = 600,
                 max_staleness: int | None = None, **layout):
        self.store, self.name, self.n, self.channel = store, name, n, channel
        self.lease_seconds, self.max_staleness = lease_seconds, max_staleness
        self.layout = {"batch_size": 1 << 30, **layout}  # one batch per group
        self.report: Counter = Counter()
        self._acked: set = set()

    def _stale(self, oldest: str | None, current: str | None) -> bool:
        if self.max_staleness is None or oldest is None or current is None:
            return False
        try:
            return int(current) - int(oldest) > self.max_staleness
        except ValueError:
            return False

    def claim(self) -> Batch | None:
        """The next ready group as one batch (leased to this consumer), or None when none is ready."""
        now = time.time()
        with self.store.write() as conn:
            row = conn.execute("SELECT group_id FROM consumption WHERE consumer = ? AND status = 'leased' "
                               "ORDER BY claimed_at LIMIT 1", [self.name]).fetchone()  # mine, after a restart
            group = row[0] if row else None
            current = self.store.policy_version()
            while group is None:
                ready = conn.execute(READY, {"channel": self.channel, "n": self.n, "now": now}).fetchall()
                if not ready:
                    return None
                for group_id, oldest in ready:
                    if self._stale(oldest, current):
                        conn.execute("INSERT OR REPLACE INTO consumption (group_id, channel, consumer, claimed_at, "
                                     "status) VALUES (?, ?, ?, ?, 'stale')", [group_id, self.channel, self.name, now_iso()])
                        self.report["groups set aside: stale"] += 1
                        continue
                    group = group_id
                    break
            conn.execute("INSERT OR REPLACE INTO consumption (group_id, channel, consumer, claimed_at, lease_until, "
                         "status) VALUES (?, ?, ?, ?, ?, 'leased')",
                         [group, self.channel, self.name, now_iso(), now + self.lease_seconds])
        batches = list(step_batches(self.store, where="s.group_id = ?", params=[group], **self.layout))
        batch = batches[0] if batches else Batch({}, {"step_id": []})
        batch.meta["group_id"] = group
        return batch

    def ack(self, batch: Batch) -> None:
        group = batch.meta["group_id"]
        self._acked.add(group)
        with self.store.write() as conn:
            updated = conn.execute("UPDATE consumption SET status = 'acked', acked_at = ?, rows = ? "
                                   "WHERE group_id = ? AND consumer = ? AND status = 'leased'",
                                   [now_iso(), len(batch), group, self.name]).rowcount
        if not updated:
            raise KeyError(f"group {group!r} is not leased to {self.name!r} (its lease ran out?)")

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
