"""The fleet's consumer: groups claimed through the coordinator, their steps fetched from the nodes that hold them.

    trainer = RemoteConsumer("postgresql://stepmill@db-host/stepmill", "trainer-0", token=TOKEN)
    for batch in trainer:              # the next one acknowledges the one before, as ``Consumer`` does
        train_on(batch.tensors)
    # or several groups per optimizer step, acknowledged together (given back on an error):
    with trainer.step(4) as batches:
        optimizer_step(batches)

The same interface as ``trainer_bridge.consume.Consumer`` (``claim() → Batch | None``,
``claim_many(k) → list[Batch]``, ``ack(batch)``, ``ack_many(batches)``, ``release_many``, ``renew``,
``step(k)``, iteration), so a trainer does not know which node a group lives on:

- ``claim_many`` leases the oldest ready groups (``Coordinator.claim``: readiness, staleness and the
  policy version are the coordinator's) and fetches their steps with ``GET /v1/groups/{id}/batch``
  from each node that holds some of its runs (``stepmill serve`` there, with the write token); a
  group spread over several nodes is fetched from each and joined (``concat_step_batches``); a
  consumer is never handed a group it holds;
- while a batch is held, a thread renews its lease every third of ``lease_seconds``; a consumer that dies
  stops renewing, and its groups go back to the others when the lease runs out;
- ``ack_many`` acknowledges its groups through the coordinator in one transaction, all or none
  (``Conflict`` naming each group whose lease ran out and went to another consumer, as with ``Consumer``);
- a node that cannot serve a claimed group (down, or the run missing from its file) does not stop the
  trainer: the group's lease is cut to ``retry_after_s`` and the next group is claimed; the group comes
  back to some consumer after that (and a node that stopped heartbeating keeps its groups out: see
  ``Coordinator.lost_groups``). ``report`` counts such groups;
- a consumer restarting under the same name first takes back its own unacknowledged groups.

Blocking calls (HTTP, PostgreSQL): a trainer's thread, never an event loop.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from collections import Counter
from urllib.parse import quote, urlencode

from stepmill.errors import BadInput, ConfigError, Conflict, NotFound, StoreUnavailable
from stepmill.fleet.batch_wire import LAYOUT_FIELDS, batch_from_bytes
from stepmill.store.fleet_ledger import GroupLease, Coordinator
from stepmill.trainer_bridge.consume import GroupStream
from stepmill.trainer_bridge.layouts import Batch, concat_step_batches


log = logging.getLogger("stepmill")


class RemoteConsumer(GroupStream):
    """``Consumer`` for a fleet: ``coordinator`` is a ``Coordinator``, its URL, or None (``STEPMILL_COORDINATOR``).
    ``max_staleness``: set aside groups more policy versions behind than this (the fleet's own limit, when
    lower, holds too). ``token``: the nodes' write token (one for all), or ``tokens``: node id → token;
    else the token in ``confdir``, read when first needed. ``wait_s``: how long a claim waits for the token
    and for a ready group (a trainer started before the rollout). Layout options (``max_prompt_length``, ``max_response_length``,
    ``overlong``, ``pad_id``) are those of ``step_batches``; each group is one batch."""

    def __init__(self, coordinator: Coordinator | str | None, name: str, *, channel: str | None = "train",
                 lease_seconds: float = 600.0, retry_after_s: float = 30.0, max_staleness: int | None = None,
                 token: str | None = None, tokens: dict[str, str] | None = None, confdir: str | None = None,
                 timeout: float = 120.0, wait_s: float = 0.0, **layout):
        unknown = set(layout) - set(LAYOUT_FIELDS)
        if unknown:
            raise BadInput(f"unknown layout option {sorted(unknown)[0]!r} (one batch per group; "
                           f"options: {', '.join(LAYOUT_FIELDS)})")
        self.fleet = coordinator if isinstance(coordinator, Coordinator) else Coordinator(coordinator)
        self.name, self.channel, self.lease_seconds, self.retry_after_s = name, channel, lease_seconds, retry_after_s
        self.timeout, self.layout, self.max_staleness = timeout, layout, max_staleness
        if token is None and not tokens:
            from stepmill.auth.write_token import read_token

            token = read_token(confdir)  # None until the rollout makes it: ``not_ready`` reads again
        self.wait_s, self._confdir = wait_s, confdir
        self._token, self._tokens = token, dict(tokens or {})
        self.report: Counter = Counter()
        self.failures: list[str] = []  # why nodes could not serve groups, oldest first
        self._acked: set = set()
        self._held: dict[str, GroupLease] = {}  # group id -> its claim, renewed while held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._resumed = False

    # --- the trainer's side ------------------------------------------------------------------------------

    def not_ready(self) -> str | None:
        """The nodes' write token, read again while missing: a trainer may start before the rollout that
        makes it (``[proxy] confdir``'s ``stepmill-token``, or ``STEPMILL_TOKEN``)."""
        if self._token is None and not self._tokens:
            from stepmill.auth.write_token import read_token, token_wanted

            self._token = read_token(self._confdir)
            if self._token is None:
                return token_wanted("the nodes'", self._confdir)
        return None

    def claim_many(self, k: int) -> list[Batch]:
        """Up to ``k`` groups, one batch each, leased to this consumer (the groups this name held before a
        restart first); an empty list when none is ready now."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise BadInput(f"k must be a positive integer, got {k!r:.40}")
        batches: list[Batch] = []
        while len(batches) < k:
            claims = self._next_claims(k - len(batches))
            if not claims:
                break
            for i, claim in enumerate(claims):
                with self._lock:
                    mine = claim.group_id in self._held
                    if mine:  # its own lease ran out and it took the group again: the batch it has, a new lease
                        self._held[claim.group_id] = claim
                if mine:
                    continue
                try:
                    batch = self._fetch(claim)
                except StoreUnavailable as exc:
                    self._put_back(claim, exc)
                    continue
                except ConfigError as exc:  # nothing is handed over: every group of this call goes back
                    self._put_back(claim, exc)
                    self.fleet.release_many(claims[i + 1:])
                    self.release_many(batches)
                    raise
                with self._lock:
                    self._held[claim.group_id] = claim
                batches.append(batch)
        if batches:
            self._start_renewing()
        return batches

    def ack_many(self, batches: list[Batch]) -> None:
        """The batches' groups are consumed, in one transaction: all, or none and a ``Conflict`` naming each
        group this consumer no longer holds (those stay held, to ack or give back); ``NotFound`` when this
        consumer does not hold one of them."""
        batches = list(batches)
        groups = [batch.meta["group_id"] for batch in batches]
        self._acked.update(groups)
        with self._lock:
            claims = [self._held.get(group) for group in groups]
        missing = [group for group, claim in zip(groups, claims) if claim is None]
        if missing:
            raise NotFound(f"group(s) {', '.join(map(repr, missing))} not held by consumer {self.name!r}")
        try:
            self.fleet.ack_many(claims)
        except Conflict as exc:  # the lost ones are no longer ours to renew; the others still are
            self._forget(getattr(exc, "groups", groups))
            raise
        self._forget(groups)
        self.report["groups acknowledged"] += len(groups)
        self.report["rows acknowledged"] += sum(len(batch) for batch in batches)

    def release_many(self, batches: list[Batch]) -> list[str]:
        """Give the batches' groups back unconsumed, at once; returns those this consumer still held."""
        groups = [batch.meta["group_id"] for batch in batches]
        with self._lock:
            claims = [self._held.pop(group) for group in groups if group in self._held]
        return self.fleet.release_many(claims) if claims else []

    def renew(self, batches: list[Batch] | None = None) -> list[str]:
        """Extend the leases now (None: of every group held) to ``lease_seconds``; returns the groups no longer
        held. The background thread does the same every third of ``lease_seconds``."""
        wanted = None if batches is None else {batch.meta["group_id"] for batch in batches}
        with self._lock:
            held = [c for c in self._held.values() if wanted is None or c.group_id in wanted]
        lost = [] if wanted is None else sorted(wanted - {c.group_id for c in held})
        return lost + self._renew(held)

    @property
    def held(self) -> list[str]:
        """The groups claimed and neither acknowledged nor given back."""
        with self._lock:
            return list(self._held)

    def _forget(self, groups) -> None:
        with self._lock:
            for group in groups:
                self._held.pop(group, None)

    def close(self) -> None:
        """Stop renewing (held groups go back when their leases run out)."""
        self._stop.set()

    def __enter__(self) -> RemoteConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- claims and leases ---------------------------------------------------------------------------------

    def _next_claims(self, k: int) -> list[GroupLease]:
        if not self._resumed:  # a restart under the same name: its own unacknowledged groups first
            self._resumed = True
            self._waiting = [c for c in self.fleet.held(self.name) if c.group_id not in self._held]
        resumed = []
        while self._waiting and len(resumed) < k:
            try:
                resumed.append(self.fleet.renew(self._waiting.pop(0), self.lease_seconds))
            except (Conflict, NotFound):
                continue  # taken over by another consumer meanwhile
        if resumed:
            return resumed
        return self.fleet.claim(self.name, n=k, lease_seconds=self.lease_seconds, channel=self.channel,
                                max_staleness=self.max_staleness)

    def _put_back(self, claim: GroupLease, exc: Exception) -> None:
        """A group its node cannot serve now: its lease cut short, so it comes back after ``retry_after_s``."""
        self.report["groups put back: a node could not serve them"] += 1
        self.failures.append(str(exc))
        try:
            self.fleet.renew(claim, self.retry_after_s)
        except (Conflict, NotFound):
            pass

    def _start_renewing(self) -> None:
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_held, name=f"stepmill-renew-{self.name}",
                                             daemon=True)
            self._renewer.start()

    def _renew_held(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            with self._lock:
                held = list(self._held.values())
            self._renew(held)

    def _renew(self, held: list[GroupLease]) -> list[str]:
        """Each claim's lease extended; the groups whose leases were lost (the ack will say so too)."""
        lost = []
        for claim in held:
            try:
                renewed = self.fleet.renew(claim, self.lease_seconds)
            except (Conflict, NotFound):  # ran out and taken by another
                self.report["leases lost while held"] += 1
                lost.append(claim.group_id)
                continue
            except StoreUnavailable:
                continue  # the coordinator is away: the next round tries again
            except Exception:  # anything else must not end the renewals of the other claims
                log.exception("stepmill: renewing the lease of group %s failed", claim.group_id)
                continue
            with self._lock:
                if self._held.get(claim.group_id) is claim:
                    self._held[claim.group_id] = renewed
        return lost

    # --- fetching from the nodes ---------------------------------------------------------------------------

    def _fetch(self, claim: GroupLease) -> Batch:
        by_node: dict[str, list[str]] = {}
        for run, node in sorted(claim.runs.items()):
            by_node.setdefault(node, []).append(run)
        parts = [self._fetch_part(claim, node, runs) for node, runs in sorted(by_node.items())]
        batch = concat_step_batches(parts, self.layout.get("pad_id", 0))
        batch.meta["group_id"] = claim.group_id
        batch.meta["nodes"] = sorted(by_node)
        batch.meta["coordinator_policy_version"] = claim.policy_version
        return batch

    def _fetch_part(self, claim: GroupLease, node: str, runs: list[str]) -> Batch:
        query = urlencode([("run", run) for run in runs] + sorted(self.layout.items()))
        url = f"{claim.nodes[node].rstrip('/')}/v1/groups/{quote(claim.group_id, safe='')}/batch?{query}"
        token = self._tokens.get(node, self._token)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token or ''}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return batch_from_bytes(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            if exc.code == 401:  # the trainer's configuration, not the node's state: every group would fail
                raise ConfigError(f"node {node!r} ({claim.nodes[node]}) refused the write token: {detail}") from None
            raise StoreUnavailable(f"node {node!r} ({claim.nodes[node]}) answered {exc.code} for group "
                                   f"{claim.group_id!r}: {detail}") from None
        except OSError as exc:
            raise StoreUnavailable(f"node {node!r} ({claim.nodes[node]}) cannot be reached for group "
                                   f"{claim.group_id!r}: {exc}") from None


__all__ = ["RemoteConsumer"]
