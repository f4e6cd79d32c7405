"""`stepmill serve`: the consumption stream over HTTP, for a trainer on another machine.

    POST /v1/claim {consumer, n?, channel?, lease_seconds?, max_staleness?}
         → 200 a safetensors file (the batch's arrays; row metadata and counts in its metadata), or 204
    POST /v1/ack   {consumer, group_id} → 200 (the group's row count was recorded when its batch was made)
    GET  /v1/groups/{group_id}/batch?run=T1&run=T2&max_prompt_length=…&max_response_length=…&overlong=…&pad_id=…
         → 200 the group's gated steps (those of the named runs, all of them without ``run``) as one
         batch, the step layout of ``Consumer``; 404 when a named run is not in this file. The fleet's
         consumer (``remote.RemoteConsumer``) claims through the coordinator and fetches here.
    GET  /v1/health

Every call but health needs the write token (``Authorization: Bearer``), as the control API does.
On the trainer's side, ``NodeConsumer`` (below) is the same iterator as ``Consumer``.
"""

from __future__ import annotations

import json
import struct
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from stepmill.auth.write_token import bearer_matches
from stepmill.errors import BadInput, Conflict, NotFound
from stepmill.protocols.http_json import send_body, send_json
from stepmill.store import Store

from stepmill.trainer_bridge.consume import Consumer, acknowledging
from stepmill.trainer_bridge.layouts import OVERLONG, Batch, group_batch

CLAIM_FIELDS = {"consumer", "n", "channel", "lease_seconds", "max_staleness"}
# The step layout's options a group's batch may be asked with (query parameters), and their types.
LAYOUT_FIELDS = {"max_prompt_length": int, "max_response_length": int, "overlong": str, "pad_id": int}


def layout_options(query: dict[str, list[str]]) -> dict:
    """The layout options of a batch request's query, checked (``BadInput`` names a bad one)."""
    options = {}
    for name, values in query.items():
        if name == "run":
            continue
        kind = LAYOUT_FIELDS.get(name)
        if kind is None:
            raise BadInput(f"unknown parameter {name!r}")
        try:
            options[name] = kind(values[-1])
        except ValueError:
            raise BadInput(f"{name} must be a whole number") from None
    if options.get("overlong", "drop") not in OVERLONG:
        raise BadInput(f"overlong must be one of {OVERLONG}")
    return options


def runs_batch(store: Store, group_id: str, runs: list[str], **layout) -> Batch:
    """The group's gated steps (only the named runs' when ``runs`` is not empty) as one step batch;
    ``NotFound`` when a named run is not in this file."""
    if runs:
        missing = sorted(set(runs) - set(store.trajectories_in_group(group_id)))
        if missing:
            raise NotFound(f"run(s) {', '.join(missing[:5])} of group {group_id!r} are not in this node's file")
    return group_batch(store, group_id, trajectory_ids=runs or None, **layout)


def batch_bytes(batch: Batch) -> bytes:
    from safetensors.numpy import save

    tensors = {name: np.ascontiguousarray(array) for name, array in batch.tensors.items()}
    return save(tensors, metadata={"meta": json.dumps(batch.meta, default=str),
                                   "report": json.dumps(dict(batch.report))})


def batch_from_bytes(data: bytes) -> Batch:
    from collections import Counter

    from safetensors.numpy import load

    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
    return Batch(load(data), json.loads(metadata.get("meta", "{}")), Counter(json.loads(metadata.get("report", "{}"))))


def make_server(db_path: str, host: str, port: int, token: str) -> ThreadingHTTPServer:
    local = threading.local()

    class Handler(BaseHTTPRequestHandler):
        def _store(self) -> Store:
            if not hasattr(local, "store"):
                local.store = Store(db_path)
            return local.store

        _answer = send_body

        def _error(self, status: int, message: str):
            send_json(self, status, {"error": message})

        def do_GET(self):
            url = urlsplit(self.path)
            if url.path.rstrip("/") == "/v1/health":
                return self._answer(200, b'{"ok": true}')
            parts = url.path.split("/")
            if len(parts) != 5 or parts[:3] != ["", "v1", "groups"] or parts[4] != "batch" or not parts[3]:
                return self._error(404, f"no endpoint {url.path}")
            if not bearer_matches(self.headers.get("Authorization"), token):
                return self._error(401, "needs the write token: Authorization: Bearer <token>")
            query = parse_qs(url.query, keep_blank_values=True)
            try:
                batch = runs_batch(self._store(), unquote(parts[3]), query.get("run", []), **layout_options(query))
            except (BadInput, NotFound) as exc:
                return self._error(exc.status, str(exc))
            return self._answer(200, batch_bytes(batch), "application/octet-stream")

        def do_POST(self):
            if not bearer_matches(self.headers.get("Authorization"), token):
                return self._error(401, "needs the write token: Authorization: Bearer <token>")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError:
                return self._error(400, "body is not JSON")
            if not isinstance(body, dict) or not isinstance(body.get("consumer"), str) or not body["consumer"]:
                return self._error(400, "give a consumer name")
            path = self.path.rstrip("/")
            if path == "/v1/claim":
                unknown = set(body) - CLAIM_FIELDS
                if unknown:
                    return self._error(400, f"unknown field {sorted(unknown)[0]!r}")
                consumer = Consumer(self._store(), body["consumer"], **{k: v for k, v in body.items()
                                                                        if k != "consumer"})
                batch = consumer.claim()
                if batch is None:
                    return self._answer(204)
                batch.report.update(consumer.report)
                return self._answer(200, batch_bytes(batch), "application/octet-stream")
            if path == "/v1/ack":
                if not isinstance(body.get("group_id"), str):
                    return self._error(400, "give a group_id")
                try:
                    self._store().ack_group(body["consumer"], body["group_id"])
                except (Conflict, NotFound) as exc:  # held by another or acknowledged already; never claimed
                    return self._error(exc.status, str(exc))
                return self._answer(200, b'{"ok": true}')
            return self._error(404, f"no endpoint {self.path}")

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, port), Handler)


class NodeConsumer:
    """``Consumer`` of one node over HTTP: ``for batch in NodeConsumer(url, "trainer-0", n=8): …; .ack(batch)``
    (a fleet's trainers use ``remote.RemoteConsumer``, which finds the node of each group)."""

    def __init__(self, url: str, name: str, *, token: str | None = None, confdir: str | None = None,
                 timeout: float = 120, **params):
        from stepmill.auth.write_token import read_token

        self.url, self.name, self.timeout = url.rstrip("/"), name, timeout
        self.token = token or read_token(confdir)
        self.params = params
        self._acked: set = set()

    def _post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.token or ''}"})
        return urllib.request.urlopen(request, timeout=self.timeout)

    def claim(self) -> Batch | None:
        with self._post("/v1/claim", {"consumer": self.name, **self.params}) as response:
            return None if response.status == 204 else batch_from_bytes(response.read())

    def ack(self, batch: Batch) -> None:
        self._acked.add(batch.meta["group_id"])
        self._post("/v1/ack", {"consumer": self.name, "group_id": batch.meta["group_id"]}).close()

    def __iter__(self):
        """Asking for the next batch acknowledges the one before, as ``Consumer`` does."""
        return acknowledging(self)

    def as_torch_dataset(self):
        """A torch ``IterableDataset`` of batches (each acknowledged when the next is asked for)."""
        import torch

        consumer = self

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                for batch in consumer:
                    yield batch.to_torch()

        return Stream()


__all__ = ["make_server", "NodeConsumer", "batch_bytes", "batch_from_bytes", "runs_batch"]
