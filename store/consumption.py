"""Consumption: whole groups handed to trainers, each once (the ``consumption`` table).

The contract, which any store that serves trainers keeps:

- A group is ready on a channel when it has at least ``n`` complete trajectories and none still
  open; two channels (``train``, ``val``) never mix.
- ``claim_groups`` hands up to ``k`` ready groups to one consumer in one write transaction, so two
  consumers never hold the same group. A consumer instance names itself with a ``session`` (a
  consumer process's own id): a claim never hands a session a group it already holds, and first
  takes up the groups its name holds under another session (a trainer that restarted resumes
  them). ``claim_group`` is one claim under a session of its own: the name's held group first.
- A lease runs out: ``lease_seconds`` after the claim (or the last ``renew_groups``), a group
  nobody acknowledged is ready again for any consumer (its holder died).
- An ack takes effect once: ``ack_groups`` acknowledges all its groups in one transaction or none
  (``Conflict`` names every group no longer held: its lease ran out and another took it, a restart
  took it up, it was acknowledged or given back). A holder whose lease ran out may still ack while
  nobody else took the group. A group nobody ever claimed is ``NotFound``.
- ``release_groups`` gives groups back unconsumed, ready again at once.
- Staleness: at claim, the current policy version minus the oldest of the group's trajectories
  (NULL when they are not integers) is kept on the group's row. With ``max_staleness``, a ready group
  more than that many versions behind is set aside as ``stale`` (never handed out), and the claim
  says how many it set aside.

Leases are in seconds since the epoch; a caller may pass ``now`` so that they follow its clock.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from stepmill.errors import BadInput, Conflict, NotFound
from stepmill.store.connection import Transactions
from stepmill.store.ids import new_id, now_iso
from stepmill.store.state import State

# Ready groups of a channel, oldest first, without those acknowledged, set aside or under a lease
# that still runs.
_READY = """
SELECT t.group_id
FROM trajectories t
WHERE t.channel = :channel AND t.group_id IS NOT NULL
GROUP BY t.group_id
HAVING sum(t.status = 'complete') >= :n AND sum(t.status != 'complete') = 0
   AND (:scored = 0 OR sum(t.reward IS NULL) = 0)
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


@dataclass(frozen=True)
class Claims:
    """What a claim of several got: the groups leased, oldest first (those the consumer's name held
    under another session first), and how many groups it set aside as stale on the way."""

    group_ids: tuple[str, ...]
    stale: int = 0


def _integer(version: str | None) -> int | None:
    try:
        return None if version is None else int(version)
    except ValueError:
        return None


def _versions(conn: sqlite3.Connection, group_id: str, current: str | None) -> tuple[str | None, int | None]:
    """The group's oldest trajectory policy version, and how far the current one is ahead of it
    (None unless every version there is an integer)."""
    versions = [row[0] for row in conn.execute("SELECT DISTINCT policy_version FROM trajectories "
                                               "WHERE group_id = ? AND policy_version IS NOT NULL", [group_id])]
    numbers = [_integer(v) for v in versions]
    if not versions:
        return None, None
    if None in numbers:
        return min(versions), None
    oldest = min(numbers)
    now = _integer(current)
    return str(oldest), None if now is None else now - oldest


def _ids(group_ids: Iterable[str]) -> list[str]:
    ids = list(dict.fromkeys(group_ids))
    if not all(isinstance(g, str) and g for g in ids):
        raise BadInput("group ids are non-empty strings")
    return ids


def _held(conn: sqlite3.Connection, consumer: str, ids: list[str], session: str | None) -> tuple[list, list]:
    """The groups of ``ids`` leased to the consumer (and its session, when one is given), and the others."""
    rows = {row[0]: row for row in conn.execute(
        f"SELECT group_id, consumer, status, holder FROM consumption WHERE group_id IN ({', '.join('?' * len(ids))})",
        ids)}
    held, lost = [], []
    for group in ids:
        row = rows.get(group)
        ok = row is not None and row[1] == consumer and row[2] == "leased" and (session is None or row[3] == session)
        (held if ok else lost).append(group)
    return held, [(group, group in rows) for group in lost]


def _refusal(consumer: str, lost: list[tuple[str, bool]], total: int, what: str) -> Exception:
    """NotFound when no group refused was ever claimed, else Conflict; naming each group."""
    names = ", ".join(repr(group) for group, _ in lost)
    if total == 1:
        message = f"group {names} is not leased to {consumer!r} (its lease ran out?)"
    else:
        message = (f"group(s) {names} not leased to {consumer!r} (their leases ran out?): none of the {total} "
                   f"groups was {what}")
    return Conflict(message) if any(claimed for _, claimed in lost) else NotFound(message)


class Consumption:
    """Claims with leases and acks that take effect once, each call one write transaction (a claim
    reads ``state``'s policy version for the staleness it keeps)."""

    def __init__(self, tx: Transactions, state: State):
        self.tx = tx
        self.state = state

    def claim_groups(self, consumer: str, k: int = 1, *, session: str | None = None, channel: str = "train",
                     n: int = 8, lease_seconds: float = 600, max_staleness: int | None = None,
                     scored: bool = False, now: float | None = None) -> Claims:
        """Lease up to ``k`` groups to the consumer's ``session`` in one write transaction: first those
        its name holds under another session (a restart), then the oldest ready ones of ``channel``
        (setting stale ones aside). None: a session of this call's own. ``scored``: only groups whose
        every trajectory has its reward (what a trainer needs; a rollout scores a round as it ends)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise BadInput(f"k must be a positive integer, got {k!r:.40}")
        now = time.time() if now is None else now
        session = session or new_id("session")
        stale = 0
        with self.tx.write() as conn:
            taken = [row[0] for row in conn.execute(
                "SELECT group_id FROM consumption WHERE consumer = ? AND status = 'leased' AND holder IS NOT ? "
                "ORDER BY claimed_at, group_id LIMIT ?", [consumer, session, k])]
            for group in taken:  # staleness stays as it was at the first claim
                conn.execute("UPDATE consumption SET holder = ?, lease_until = ? WHERE group_id = ?",
                             [session, now + lease_seconds, group])
            current = self.state.policy_version()
            while len(taken) < k:
                ready = [row[0] for row in conn.execute(_READY, {"channel": channel, "n": n, "now": now,
                                                                     "scored": int(bool(scored))})]
                if not ready:
                    break
                for group in ready:
                    oldest, staleness = _versions(conn, group, current)
                    too_old = max_staleness is not None and staleness is not None and staleness > max_staleness
                    conn.execute("INSERT OR REPLACE INTO consumption (group_id, channel, consumer, claimed_at, "
                                 "lease_until, status, holder, staleness, policy_version, oldest_version) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                 [group, channel, consumer, now_iso(), None if too_old else now + lease_seconds,
                                  "stale" if too_old else "leased", None if too_old else session, staleness,
                                  current, oldest])
                    if too_old:
                        stale += 1
                        continue
                    taken.append(group)
                    if len(taken) == k:
                        break
        return Claims(tuple(taken), stale)

    def claim_group(self, consumer: str, *, channel: str = "train", n: int = 8, lease_seconds: float = 600,
                    max_staleness: int | None = None, now: float | None = None) -> Claim:
        """Lease the consumer's own unacknowledged group, else the oldest ready group of ``channel``
        (setting stale ones aside), in one write transaction."""
        claims = self.claim_groups(consumer, 1, channel=channel, n=n, lease_seconds=lease_seconds,
                                   max_staleness=max_staleness, now=now)
        return Claim(claims.group_ids[0] if claims.group_ids else None, claims.stale)

    def set_group_rows(self, consumer: str, group_id: str, rows: int) -> None:
        """How many rows the consumer's batch of a group it holds has, recorded when the batch is made
        (an ack over HTTP carries no batch to count); nothing when the group is not leased to it."""
        with self.tx.write() as conn:
            conn.execute("UPDATE consumption SET rows = ? WHERE group_id = ? AND consumer = ? AND status = 'leased'",
                         [rows, group_id, consumer])

    def ack_groups(self, consumer: str, group_ids: Iterable[str], *, session: str | None = None,
                   rows: Mapping[str, int] | None = None) -> None:
        """Mark the groups consumed, all in one transaction or none: ``Conflict`` naming each group
        not leased to the consumer (to its ``session``, when given). ``rows``: group → how many rows
        the trainer got from it (a group left out keeps what ``set_group_rows`` recorded)."""
        ids = _ids(group_ids)
        if not ids:
            return
        rows = dict(rows or {})
        with self.tx.write() as conn:
            held, lost = _held(conn, consumer, ids, session)
            if lost:
                raise _refusal(consumer, lost, len(ids), "acknowledged")
            acked_at = now_iso()
            for group in held:
                conn.execute("UPDATE consumption SET status = 'acked', acked_at = ?, rows = coalesce(?, rows) "
                             "WHERE group_id = ?", [acked_at, rows.get(group), group])

    def ack_group(self, consumer: str, group_id: str, *, rows: int | None = None) -> None:
        """Mark the group consumed (``rows``: how many rows the trainer got from it; None keeps what
        ``set_group_rows`` recorded)."""
        self.ack_groups(consumer, [group_id], rows=None if rows is None else {group_id: rows})

    def release_groups(self, consumer: str, group_ids: Iterable[str], *, session: str | None = None) -> list[str]:
        """Give the groups leased to the consumer (its ``session``) back unconsumed, ready at once for
        any consumer; the others are left as they are. Returns those given back."""
        ids = _ids(group_ids)
        if not ids:
            return []
        with self.tx.write() as conn:
            held, _ = _held(conn, consumer, ids, session)
            for group in held:
                conn.execute("UPDATE consumption SET status = 'released', lease_until = NULL, holder = NULL "
                             "WHERE group_id = ?", [group])
        return held

    def renew_groups(self, consumer: str, group_ids: Iterable[str], *, session: str | None = None,
                     lease_seconds: float = 600, now: float | None = None) -> list[str]:
        """Extend the leases of the groups the consumer (its ``session``) holds to ``lease_seconds``
        from now (a long optimizer step keeps its groups). Returns the groups it no longer holds."""
        ids = _ids(group_ids)
        if not ids:
            return []
        now = time.time() if now is None else now
        with self.tx.write() as conn:
            held, lost = _held(conn, consumer, ids, session)
            for group in held:
                conn.execute("UPDATE consumption SET lease_until = ? WHERE group_id = ?", [now + lease_seconds, group])
        return [group for group, _ in lost]

    def consumption_staleness(self, *, channel: str | None = None, consumer: str | None = None) -> list[dict]:
        """Every group handed out (or set aside), oldest claim first: group_id, channel, consumer, status
        (leased | acked | released | stale), staleness (policy versions behind at its claim; None when
        they are not integers), policy_version (current at the claim), oldest_version (the group's
        oldest trajectory's), rows, claimed_at, acked_at."""
        return self.tx.query(
            "SELECT group_id, channel, consumer, status, staleness, policy_version, oldest_version, rows, claimed_at, "
            "acked_at FROM consumption WHERE (:channel IS NULL OR channel = :channel) "
            "AND (:consumer IS NULL OR consumer = :consumer) ORDER BY claimed_at, group_id",
            {"channel": channel, "consumer": consumer})
