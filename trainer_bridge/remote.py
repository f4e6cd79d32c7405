"""The fleet's consumer: groups claimed through the coordinator, their steps fetched from the nodes that hold them.

    trainer = RemoteConsumer("postgresql://stepmill@db-host/stepmill", "trainer-0", token=TOKEN)
    for batch in trainer:              # the next one acknowledges the one before, as ``Consumer`` does
        train_on(batch.tensors)
    # or: batch = trainer.claim(); …; trainer.ack(batch)

The same interface as ``trainer_bridge.consume.Consumer`` (``claim() → Batch | None``, ``ack(batch)``,
iteration), so a trainer does not know which node a group lives on:

- ``claim`` leases the oldest ready group (``Coordinator.claim``: readiness, staleness and the policy
  version are the coordinator's) and fetches its steps with ``GET /v1/groups/{id}/batch`` from each
  node that holds some of its runs (``stepmill serve`` there, with the write token); a group spread
  over several nodes is fetched from each and joined (``concat_step_batches``);
- while a batch is held, a thread renews its lease every third of ``lease_s``; a consumer that dies
  stops renewing, and its groups go back to the others when the lease runs out;
- ``ack`` acknowledges through the coordinator (once: ``Conflict`` when the lease ran out and another
  consumer took the group, as with ``Consumer``);
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
from typing import Iterator
from urllib.parse import quote, urlencode

from stepmill.errors import BadInput, ConfigError, Conflict, NotFound, StoreUnavailable
from stepmill.store.coordinator import Claim, Coordinator

from stepmill.trainer_bridge.consume import acknowledging
from stepmill.trainer_bridge.layouts import Batch, concat_step_batches
from stepmill.trainer_bridge.serve import LAYOUT_FIELDS, batch_from_bytes


log = logging.getLogger("stepmill")


class RemoteConsumer:
    """``Consumer`` for a fleet: ``coordinator`` is a ``Coordinator``, its URL, or None (``STEPMILL_COORDINATOR``).
    ``token``: the nodes' write token (one for all), or ``tokens``: node id → token; else the token in
    ``confdir``. Layout options (``max_prompt_length``, ``max_response_length``, ``overlong``, ``pad_id``)
    are those of ``step_batches``; each group is one batch."""

    def __init__(self, coordinator: Coordinator | str | None, name: str, *, channel: str | None = "train",
                 lease_s: float = 600.0, retry_after_s: float = 30.0, token: str | None = None,
                 tokens: dict[str, str] | None = None, confdir: str | None = None, timeout: float = 120.0,
                 **layout):
        unknown = set(layout) - set(LAYOUT_FIELDS)
        if unknown:
            raise BadInput(f"unknown layout option {sorted(unknown)[0]!r} (one batch per group; "
                           f"options: {', '.join(LAYOUT_FIELDS)})")
        self.fleet = coordinator if isinstance(coordinator, Coordinator) else Coordinator(coordinator)
        self.name, self.channel, self.lease_s, self.retry_after_s = name, channel, lease_s, retry_after_s
        self.timeout, self.layout = timeout, layout
        if token is None and not tokens:
            from stepmill.auth.write_token import read_token

            token = read_token(confdir)
        self._token, self._tokens = token, dict(tokens or {})
        self.report: Counter = Counter()
        self.failures: list[str] = []  # why nodes could not serve groups, oldest first
        self._acked: set = set()
        self._held: dict[str, Claim] = {}  # group id -> its claim, renewed while held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._resumed = False

    # --- the trainer's side ------------------------------------------------------------------------------

    def claim(self) -> Batch | None:
        """The next ready group as one batch (leased to this consumer), or None when none is ready now."""
        while True:
            claim = self._next_claim()
            if claim is None:
                return None
            try:
                batch = self._fetch(claim)
            except StoreUnavailable as exc:
                self._put_back(claim, exc)
                continue
            except ConfigError as exc:
                self._put_back(claim, exc)
                raise
            with self._lock:
                self._held[claim.group_id] = claim
            self._start_renewing()
            return batch

    def ack(self, batch: Batch) -> None:
        """The batch's group is consumed. ``Conflict`` when it is no longer leased to this consumer (its lease
        ran out and another took it, or it was acknowledged already); ``NotFound`` when this consumer never
        claimed it."""
        group = batch.meta["group_id"]
        self._acked.add(group)
        with self._lock:
            claim = self._held.get(group)
        if claim is None:
            raise NotFound(f"group {group!r} is not held by consumer {self.name!r}")
        try:
            self.fleet.ack(claim)
        finally:  # acknowledged, or refused for good (Conflict): no longer ours to renew either way
            with self._lock:
                self._held.pop(group, None)
        self.report["groups acknowledged"] += 1
        self.report["rows acknowledged"] += len(batch)

    def release(self, batch: Batch) -> None:
        """Give the batch's group back unconsumed (another consumer may take it at once)."""
        with self._lock:
            claim = self._held.pop(batch.meta["group_id"], None)
        if claim is not None:
            self.fleet.release(claim)

    def __iter__(self) -> Iterator[Batch]:
        """Ready groups until none is left; asking for the next acknowledges the one before."""
        return acknowledging(self)

    def close(self) -> None:
        """Stop renewing (held groups go back when their leases run out)."""
        self._stop.set()

    def __enter__(self) -> RemoteConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- claims and leases ---------------------------------------------------------------------------------

    def _next_claim(self) -> Claim | None:
        if not self._resumed:  # a restart under the same name: its own unacknowledged groups first
            self._resumed = True
            self._waiting = [c for c in self.fleet.held(self.name) if c.group_id not in self._held]
        while self._waiting:
            try:
                return self.fleet.renew(self._waiting.pop(0), self.lease_s)
            except (Conflict, NotFound):
                continue  # taken over by another consumer meanwhile
        claims = self.fleet.claim(self.name, n=1, lease_s=self.lease_s, channel=self.channel)
        return claims[0] if claims else None

    def _put_back(self, claim: Claim, exc: Exception) -> None:
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
        while not self._stop.wait(self.lease_s / 3):
            with self._lock:
                held = list(self._held.values())
            for claim in held:
                try:
                    renewed = self.fleet.renew(claim, self.lease_s)
                except (Conflict, NotFound):  # ran out and taken by another: the ack will say so
                    self.report["leases lost while held"] += 1
                    continue
                except StoreUnavailable:
                    continue  # the coordinator is away: the next round tries again
                except Exception:  # anything else must not end the renewals of the other claims
                    log.exception("stepmill: renewing the lease of group %s failed", claim.group_id)
                    continue
                with self._lock:
                    if claim.group_id in self._held:
                        self._held[claim.group_id] = renewed

    # --- fetching from the nodes ---------------------------------------------------------------------------

    def _fetch(self, claim: Claim) -> Batch:
        by_node: dict[str, list[str]] = {}
        for run, node in sorted(claim.runs.items()):
            by_node.setdefault(node, []).append(run)
        parts = [self._fetch_part(claim, node, runs) for node, runs in sorted(by_node.items())]
        batch = concat_step_batches(parts, self.layout.get("pad_id", 0))
        batch.meta["group_id"] = claim.group_id
        batch.meta["nodes"] = sorted(by_node)
        batch.meta["coordinator_policy_version"] = claim.policy_version
        return batch

    def _fetch_part(self, claim: Claim, node: str, runs: list[str]) -> Batch:
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
