"""Consumption: whole groups handed to trainers, each once (the ``consumption`` table).

The contract, which any store that serves trainers keeps:

- A group is ready on a channel when it has at least ``n`` complete trajectories and none still
  open; two channels (``train``, ``val``) never mix.
- ``claim_group`` hands a ready group to one consumer at a time: the lease is taken in one write
  transaction, so two consumers never hold the same group. A consumer that claims again under the
  same name first gets back its own unacknowledged group (a trainer that restarts resumes).
- A lease runs out: ``lease_seconds`` after the claim, a group nobody acknowledged is ready again
  for any consumer (its holder died).
- An ack takes effect once: ``ack_group`` succeeds only for the consumer holding the lease, and an
  acknowledged group is never handed out again. Acknowledging a group held by another, or one
  already acknowledged or set aside, raises ``Conflict``; one nobody claimed raises ``NotFound``.
- Stale groups: with ``max_staleness``, a ready group whose oldest trajectory is more than that
  many policy versions behind the current one is set aside as ``stale`` (never handed out), and
  the claim says how many it set aside.

Leases are in seconds since the epoch; a caller may pass ``now`` so that they follow its clock.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass

from stepmill.errors import Conflict, NotFound
from stepmill.store.ids import now_iso

# Ready groups of a channel, oldest first, without those acknowledged, set aside or under a lease
# that still runs.
_READY = """
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


@dataclass(frozen=True)
class Claim:
    """What one claim got: the group leased (None when no group is ready) and how many groups it
    set aside as stale on the way."""

    group_id: str | None
    stale: int = 0


def _too_old(oldest: str | None, current: str | None, max_staleness: int | None) -> bool:
    """Policy versions are compared as integers; a version that is not one is never stale."""
    if max_staleness is None or oldest is None or current is None:
        return False
    try:
        return int(current) - int(oldest) > max_staleness
    except ValueError:
        return False


def _held_by(conn: sqlite3.Connection, consumer: str) -> str | None:
    row = conn.execute("SELECT group_id FROM consumption WHERE consumer = ? AND status = 'leased' "
                       "ORDER BY claimed_at LIMIT 1", [consumer]).fetchone()
    return row[0] if row else None


class Consumption:
    """Claims with leases and acks that take effect once; a part of ``Store`` (it uses the store's
    ``write()`` transactions and ``policy_version()``)."""

    def claim_group(self, consumer: str, *, channel: str = "train", n: int = 8, lease_seconds: float = 600,
                    max_staleness: int | None = None, now: float | None = None) -> Claim:
        """Lease the consumer's own unacknowledged group, else the oldest ready group of ``channel``
        (setting stale ones aside), in one write transaction."""
        now = time.time() if now is None else now
        stale = 0
        with self.write() as conn:
            group = _held_by(conn, consumer)
            current = self.policy_version()
            while group is None:
                ready = conn.execute(_READY, {"channel": channel, "n": n, "now": now}).fetchall()
                if not ready:
                    return Claim(None, stale)
                for group_id, oldest in ready:
                    if _too_old(oldest, current, max_staleness):
                        conn.execute("INSERT OR REPLACE INTO consumption (group_id, channel, consumer, claimed_at, "
                                     "status) VALUES (?, ?, ?, ?, 'stale')", [group_id, channel, consumer, now_iso()])
                        stale += 1
                        continue
                    group = group_id
                    break
            conn.execute("INSERT OR REPLACE INTO consumption (group_id, channel, consumer, claimed_at, lease_until, "
                         "status) VALUES (?, ?, ?, ?, ?, 'leased')",
                         [group, channel, consumer, now_iso(), now + lease_seconds])
        return Claim(group, stale)

    def set_group_rows(self, consumer: str, group_id: str, rows: int) -> None:
        """How many rows the consumer's batch of a group it holds has, recorded when the batch is made
        (an ack over HTTP carries no batch to count); nothing when the group is not leased to it."""
        with self.write() as conn:
            conn.execute("UPDATE consumption SET rows = ? WHERE group_id = ? AND consumer = ? AND status = 'leased'",
                         [rows, group_id, consumer])

    def ack_group(self, consumer: str, group_id: str, *, rows: int | None = None) -> None:
        """Mark the group consumed (``rows``: how many rows the trainer got from it; None keeps what
        ``set_group_rows`` recorded)."""
        with self.write() as conn:
            updated = conn.execute("UPDATE consumption SET status = 'acked', acked_at = ?, rows = coalesce(?, rows) "
                                   "WHERE group_id = ? AND consumer = ? AND status = 'leased'",
                                   [now_iso(), rows, group_id, consumer]).rowcount
            claimed = updated or conn.execute("SELECT 1 FROM consumption WHERE group_id = ?", [group_id]).fetchone()
        if not updated:
            message = f"group {group_id!r} is not leased to {consumer!r} (its lease ran out?)"
            raise Conflict(message) if claimed else NotFound(message)
