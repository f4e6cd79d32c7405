"""``NodeConsumer``: the consumption stream of one node's `stepmill serve` (``node_server``), as a trainer
on another machine sees it: ``Consumer``'s methods, errors and iteration over HTTP.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from stepmill.errors import Conflict, NotFound
from stepmill.fleet.batch_wire import batches_from_bytes
from stepmill.trainer_bridge.consume import HeldGroups, group_ids
from stepmill.trainer_bridge.layouts import Batch


class _Refusal(urllib.error.HTTPError):
    def __init__(self, exc: urllib.error.HTTPError, message: str):
        urllib.error.HTTPError.__init__(self, exc.url, exc.code, message, exc.headers, None)
        self.args = (message,)

    def __str__(self) -> str:
        return self.args[0]


class Refused(Conflict, _Refusal):
    """The server's 409 (a group no longer held): a ``Conflict`` with its message, and the HTTP error."""

    __init__, __str__ = _Refusal.__init__, _Refusal.__str__


class Unknown(NotFound, _Refusal):
    """The server's 404 (a group nobody claimed): a ``NotFound`` with its message, and the HTTP error."""

    __init__, __str__ = _Refusal.__init__, _Refusal.__str__


def _refusal(exc: urllib.error.HTTPError) -> Exception:
    """The server's refusal as stepmill's error (still an ``HTTPError``), its message the server's."""
    kind = {409: Refused, 404: Unknown}.get(exc.code)
    if kind is None:
        return exc
    try:
        message = json.loads(exc.read()).get("error") or str(exc.reason)
    except (ValueError, AttributeError):
        message = str(exc.reason)
    return kind(exc, message)


class NodeConsumer(HeldGroups):
    """``Consumer`` of one node over HTTP: ``for batch in NodeConsumer(url, "trainer-0", n=8): …``, or
    ``claim_many(k)`` … ``ack_many(batches)`` (``step(k)``), ``renew()``, ``release_many`` (a fleet's
    trainers use ``remote_consumer.RemoteConsumer``, which finds the node of each group). A refused ack is a
    ``Conflict`` (409) naming the groups no longer held, an unknown group ``NotFound`` (404); both are
    also ``urllib.error.HTTPError``."""

    def __init__(self, url: str, name: str, *, token: str | None = None, confdir: str | None = None,
                 timeout: float = 120, session: str | None = None, wait_s: float = 0.0, **params):
        from stepmill.auth.write_token import read_token

        super().__init__(session)
        self.url, self.name, self.timeout, self.wait_s = url.rstrip("/"), name, timeout, wait_s
        self.token, self._confdir = token or read_token(confdir), confdir
        self.params = params
        self.lease_seconds = params.get("lease_seconds", 600)

    def not_ready(self) -> str | None:
        """The node's write token, read again while missing (the rollout makes it: ``wait_s``)."""
        from stepmill.auth.write_token import read_token, token_wanted

        self.token = self.token or read_token(self._confdir)
        return None if self.token else token_wanted("the node's", self._confdir)

    def _post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps({"consumer": self.name, **body}).encode(),
                                         method="POST", headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {self.token or ''}"})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise _refusal(exc) from None

    def claim_many(self, k: int) -> list[Batch]:
        """Up to ``k`` groups' batches, leased to this consumer in one transaction; [] when none is ready."""
        with self._post("/v1/claims", {"session": self.session, "k": k, **self.params}) as response:
            batches = [] if response.status == 204 else batches_from_bytes(response.read())
        if batches:
            self.report.update(batches[0].report)
        self.held += group_ids(batches)
        return batches

    def _ack_groups(self, groups: list[str]) -> None:
        self._post("/v1/ack", {"session": self.session, "group_ids": groups}).close()

    def _release_groups(self, groups: list[str]) -> list[str]:
        with self._post("/v1/release", {"session": self.session, "group_ids": groups}) as response:
            return json.loads(response.read())["released"]

    def _renew_groups(self, groups: list[str]) -> list[str]:
        with self._post("/v1/renew", {"session": self.session, "group_ids": groups,
                                      "lease_seconds": self.lease_seconds}) as response:
            return json.loads(response.read())["lost"]

    def as_torch_dataset(self):
        """A torch ``IterableDataset`` of batches (each acknowledged when the next is asked for)."""
        import torch

        consumer = self

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                for batch in consumer:
                    yield batch.to_torch()

        return Stream()


__all__ = ["NodeConsumer", "Refused", "Unknown"]
