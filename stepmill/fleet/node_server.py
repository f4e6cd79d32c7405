"""`stepmill serve`: the consumption stream over HTTP, for a trainer on another machine.

    POST /v1/claim  {consumer, session?, n?, channel?, lease_seconds?, max_staleness?, scored?}
         → 200 a safetensors file (the batch's arrays; row metadata and counts in its metadata), or 204
    POST /v1/claims {consumer, k, session?, n?, …} → 200 up to k groups' batches in one safetensors file
         (``batch_wire.batches_from_bytes``), or 204
    POST /v1/ack    {consumer, group_id | group_ids, session?} → 200: all acknowledged in one transaction,
         or none and 409 naming each group no longer held (404: never claimed). The row counts were
         recorded when the batches were made.
    POST /v1/release {consumer, group_ids, session?} → 200 {"released": [...]}: given back at once
    POST /v1/renew   {consumer, group_ids, session?, lease_seconds?} → 200 {"lost": [...]}
    GET  /v1/groups/{group_id}/batch?run=T1&run=T2&max_prompt_length=…&max_response_length=…&overlong=…&pad_id=…
         → 200 the group's gated steps (those of the named runs, all of them without ``run``) as one
         batch, the step layout of ``Consumer``; 404 when a named run is not in this file. The fleet's
         consumer (``remote_consumer.RemoteConsumer``) claims through the coordinator and fetches here.
    GET  /v1/health

Every call but health needs the write token (``Authorization: Bearer``), as the control API does.
``session`` names one consumer instance (``Consumer``'s): it is never handed a group it holds, and a
new session under the same name (a restarted trainer) takes up the name's groups first; a claim
without one is a session of its own. On the trainer's side, ``NodeConsumer`` (``node_consumer.py``) is
``Consumer`` over HTTP: the same methods, errors (``Conflict``, ``NotFound``) and iteration.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from stepmill.auth.write_token import bearer_matches
from stepmill.errors import BadInput, Conflict, NotFound
from stepmill.fleet.batch_wire import LAYOUT_FIELDS, batch_bytes, batches_bytes
from stepmill.http_answers import send_body, send_json
from stepmill.store import Store
from stepmill.trainer_bridge.consume import Consumer
from stepmill.trainer_bridge.layouts import OVERLONG, Batch, group_batch

CLAIM_FIELDS = {"consumer", "session", "n", "channel", "lease_seconds", "max_staleness", "scored"}


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


def _group_list(body: dict) -> list[str]:
    """The request's groups: ``group_ids`` (a list) or one ``group_id``; BadInput otherwise."""
    groups = body.get("group_ids", [body["group_id"]] if "group_id" in body else None)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, str) and g for g in groups):
        raise BadInput("give a group_id or a non-empty list of group_ids")
    return groups


def _session(body: dict) -> str | None:
    session = body.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        raise BadInput("session must be a non-empty string")
    return session


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
            try:
                return self._post(path, body)
            except (BadInput, Conflict, NotFound) as exc:  # held by another or acknowledged already; never claimed
                return self._error(exc.status, str(exc))

        def _post(self, path: str, body: dict):
            if path in ("/v1/claim", "/v1/claims"):
                fields = CLAIM_FIELDS | ({"k"} if path == "/v1/claims" else set())
                unknown = set(body) - fields
                if unknown:
                    return self._error(400, f"unknown field {sorted(unknown)[0]!r}")
                _session(body)
                consumer = Consumer(self._store(), body["consumer"], **{k: v for k, v in body.items()
                                                                        if k not in ("consumer", "k")})
                if path == "/v1/claim":
                    batch = consumer.claim()
                    if batch is None:
                        return self._answer(204)
                    batch.report.update(consumer.report)
                    return self._answer(200, batch_bytes(batch), "application/octet-stream")
                batches = consumer.claim_many(body.get("k", 1))
                if not batches:
                    return self._answer(204)
                batches[0].report.update(consumer.report)
                return self._answer(200, batches_bytes(batches), "application/octet-stream")
            if path not in ("/v1/ack", "/v1/release", "/v1/renew"):
                return self._error(404, f"no endpoint {self.path}")
            store, consumer, groups, session = self._store(), body["consumer"], _group_list(body), _session(body)
            if path == "/v1/ack":
                store.ack_groups(consumer, groups, session=session)
                return self._answer(200, b'{"ok": true}')
            if path == "/v1/release":
                return send_json(self, 200, {"released": store.release_groups(consumer, groups, session=session)})
            lease = body.get("lease_seconds", 600)
            if isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease <= 0:
                raise BadInput("lease_seconds must be a positive number")
            return send_json(self, 200, {"lost": store.renew_groups(consumer, groups, session=session,
                                                                    lease_seconds=lease)})

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, port), Handler)


__all__ = ["make_server", "layout_options", "runs_batch"]
