"""The stepmill mitmproxy addon: one step record per LLM call.

Hooks follow the life of a flow: ``request`` recognises an LLM call (and answers the control
API), ``responseheaders`` taps streams, ``response`` / ``error`` write the step, and the
``websocket_*`` hooks turn each Responses ``response.create`` turn into a step.

Only LLM API paths are touched. Everything else (other paths, other hosts) passes byte-identical:
tags are taken out of a request only once its path is known to be an LLM call.

The hooks run on mitmproxy's event loop, which every agent's bytes go through. They recognise,
tag, inject and tap, then hand the finished exchange (references to bytes already in memory)
to the writer (``writer.py``); parsing, linking and SQLite happen there. Control API calls run
in a thread of their own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy import mode_specs

from stepmill.store.db import Store
from stepmill.pipeline.journal import Journal
from stepmill.auth.token import ensure_token

from stepmill.addon import engine

from stepmill.protocols import messages_via_chat

from stepmill.pipeline import recording

from stepmill.pipeline import redaction as secrets

from stepmill import tags as tagging
from stepmill.api.control import ControlAPI, Endpoints
from stepmill.auth.runs import Refused, Run, RunTable
from stepmill.pipeline.ingest import call_header, is_create_frame, is_terminal_frame
from stepmill.protocols import match
from stepmill.protocols import anthropic_messages
from stepmill.protocols import openai_chat
from stepmill.protocols import openai_responses
from stepmill.pipeline.recording import Call
from stepmill.addon.stream_tap import StreamTap
from stepmill.pipeline.writer import PRIORITIES, Handoff, ProcessWriter, ThreadWriter

log = logging.getLogger("stepmill")
ENGINE_AUTH_HEADERS = ("authorization", "x-api-key", "api-key")
WRITERS = ("process", "thread")
POLICY_REFRESH = 0.5  # seconds between checks for a policy version (or runs) set by another process
BARRIER_TIMEOUT = 60.0  # seconds a barrier waits for in-flight calls and the writer at most
BARRIER_POLL = 0.02


def hook_failed(name: str) -> None:
    """Hooks never raise into mitmproxy; the test suite reads this line to show none failed."""
    log.exception(f"stepmill: {name} hook failed")


@dataclass
class Capture:
    """What the addon knows about one LLM call while it is in flight."""

    call: Call
    started: float
    raw_request: bytes
    request_encoding: str | None
    websocket: bool = False
    added: engine.Added = field(default_factory=engine.Added)
    tap: StreamTap | None = None
    notes: list[str] = field(default_factory=list)
    done: bool = False
    translated: dict | None = None  # a Messages call served through chat: {"model", "stop_sequences"}
    render_with: str | None = None  # a vLLM engine's root, whose /tokenize renders a call it gave no ids for


@dataclass
class Turn:
    """One ``response.create`` on a Responses WebSocket, until its terminal event."""

    request: bytes
    started: float
    frames: list[tuple[float, bytes]] = field(default_factory=list)


class StepmillAddon:
    def __init__(self):
        self.db_path: str | None = None
        self.handoff: Handoff | None = None
        self.writer: ThreadWriter | ProcessWriter | None = None
        self.journal: Journal | None = None
        self.control: ControlAPI | None = None
        self.control_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stepmill-control")
        self.connection_tags: dict[str, tagging.Tags] = {}
        self.turns: dict[str, Turn] = {}
        self.probe = engine.EngineProbe()
        self.runs = RunTable()
        # Calls in flight (request seen, not yet handed off) per trajectory, and all calls handed off:
        # what a barrier waits for. Changed on the loop only.
        self.inflight: collections.Counter = collections.Counter()
        self.submitted = 0
        self.policy_version: str | None = None
        self._policy_stop = threading.Event()

    # -- set-up ---------------------------------------------------------------------------
    def load(self, loader):
        loader.add_option("stepmill_db", str, "stepmill.db", "SQLite file the steps are written to.")
        loader.add_option("stepmill_hosts", Sequence[str], [],
                          "Capture only these hosts. Empty: any host whose path is an LLM API path.")
        loader.add_option("stepmill_keep_raw", bool, False,
                          "Keep raw request and response bodies (secrets redacted) for every step, not only failed ones.")
        loader.add_option("stepmill_channel", str, "train", "Channel of new trajectories not tagged with one.")
        loader.add_option("stepmill_engine_hosts", str, "auto",
                          "Hosts treated as open-model engines (vLLM, SGLang) asked for token ids: "
                          "'auto' (hosts that answer a probe as vLLM or SGLang), 'none', or a comma list of "
                          "host[:port] (forced).")
        loader.add_option("stepmill_engine_inject", bool, True,
                          "Ask engines for token ids and logprobs the agent did not ask for.")
        loader.add_option("stepmill_messages_via_chat", bool, True,
                          "Serve Anthropic Messages calls to an engine through its chat completions (asked for "
                          "exact token ids) and translate the answer back, streamed event by event. Off: they go "
                          "to the engine's /v1/messages, which has no ids.")
        loader.add_option("stepmill_engine_strip", bool, True,
                          "Remove from the agent's response the fields only that request caused.")
        loader.add_option("stepmill_control_host", str, "stepmill.local",
                          "Host name the control API answers on through the proxy (no DNS needed).")
        loader.add_option("stepmill_writer", str, "process",
                          "Where steps are parsed and written: 'process' (a writer process of its own, on "
                          "another core) or 'thread' (a thread of the proxy).", choices=WRITERS)
        loader.add_option("stepmill_writer_priority", str, "idle",
                          "CPU priority of the writer process: 'idle' (it runs only when a core is free, never "
                          "delaying the proxy, agents or engines; commits lag while every core is busy), 'low' "
                          "(nice 10) or 'normal'.", choices=PRIORITIES)
        loader.add_option("stepmill_max_body", int, 64 * 1024 * 1024,
                          "Bytes stepmill keeps of one call's request and of its response (decoded too); past it "
                          "the bytes still pass through unchanged, and the step is recorded as truncated. "
                          "Bounds the proxy's memory for a stream that never ends. 0: no limit.")

    def configure(self, updated):
        for name, choices in (("stepmill_writer", WRITERS), ("stepmill_writer_priority", PRIORITIES)):
            if getattr(ctx.options, name) not in choices:  # mitmproxy shows choices= but leaves the check to us
                raise exceptions.OptionsError(f"{name} must be one of {', '.join(choices)}, "
                                              f"not {getattr(ctx.options, name)!r}")
        if ctx.options.stepmill_max_body < 0:
            raise exceptions.OptionsError("stepmill_max_body must be 0 (no limit) or a number of bytes")
        if self.db_path is None or updated & {"stepmill_db", "stepmill_writer", "stepmill_writer_priority"}:
            self._stop_pipeline()
            self.db_path = ctx.options.stepmill_db
            store = Store(self.db_path)  # creates or migrates the file before anyone writes
            self.policy_version = store.policy_version()
            self.runs = RunTable()
            self._read_runs(store)
            self.journal = Journal.create(self.db_path)
            if ctx.options.stepmill_writer == "thread":
                self.writer = ThreadWriter(self.db_path, self.journal)
            else:
                self.writer = ProcessWriter(self.db_path, self.journal, ctx.options.stepmill_writer_priority)
            self.handoff = Handoff(self.journal, self.writer.notify)
            self.control = ControlAPI(store, self._endpoints, token=ensure_token(ctx.options.confdir),
                                      status=self._status, on_policy_version=self._set_policy_version,
                                      on_run=self.runs.add)
            self._policy_stop = threading.Event()
            threading.Thread(target=self._watch_policy_version, args=(self.db_path, self._policy_stop),
                             name="stepmill-policy", daemon=True).start()
            log.info(f"stepmill: writing steps to {self.db_path} ({ctx.options.stepmill_writer} writer, "
                     f"journal {self.journal.folder})")
        elif "confdir" in updated and self.control is not None:
            self.control.token = ensure_token(ctx.options.confdir)

    def done(self):
        self._stop_pipeline()
        self.control_thread.shutdown(wait=False)

    def _stop_pipeline(self):
        self._policy_stop.set()
        if self.handoff is not None:
            self.handoff.close()
        if self.writer is not None:
            self.writer.close()
        if self.journal is not None and self.control is not None and not self.journal.retire(self.control.store):
            log.warning(f"stepmill: calls left in {self.journal.folder}; the next start commits them")
        if self.journal is not None:
            self.journal.release()
        if self.control is not None:
            self.control.store.close()
        self.handoff = self.writer = self.journal = self.control = None

    def _set_policy_version(self, version: str | None) -> None:
        self.policy_version = version

    def _watch_policy_version(self, db_path: str, stop: threading.Event) -> None:
        """Policy versions set by another process (`stepmill policy-version`): read off the loop, cached."""
        store = Store(db_path, readonly=True)
        seen = None
        while not stop.wait(POLICY_REFRESH):
            try:
                version = store.db.conn.execute("PRAGMA data_version").fetchone()[0]
                if version != seen:
                    seen = version
                    self.policy_version = store.policy_version()
                    self._read_runs(store)
            except Exception:
                pass  # a busy file: the cached version stands until the next look
        store.close()

    def _read_runs(self, store: Store) -> None:
        """Runs registered (by any proxy on this file) since the last look: off the loop, appended only."""
        for row in store.registered_runs(self.runs.seen_rowid):
            self.runs.add(Run(row["trajectory_id"], row["group_id"], row["channel"], row["secret_hash"], row["rowid"]))
            self.runs.seen_rowid = row["rowid"]

    def _status(self) -> dict:
        """The capture pipeline's state, for health and stats (in the control thread)."""
        out = {"writer": ctx.options.stepmill_writer}
        if ctx.options.stepmill_writer != "thread":
            out["writer_priority"] = ctx.options.stepmill_writer_priority
        if self.handoff is not None:
            out.update(self.handoff.status())
        if self.journal is not None and self.control is not None:
            out["uncommitted_bytes"] = self.journal.backlog(self.journal.committed(self.control.store))
        return out

    def _endpoints(self) -> Endpoints:
        ends = Endpoints()
        for spec in ctx.options.mode:
            try:
                mode = mode_specs.ProxyMode.parse(spec)
            except ValueError:
                continue
            host = mode.listen_host(ctx.options.listen_host) or "127.0.0.1"
            port = mode.listen_port(ctx.options.listen_port)
            url = f"http://{host}:{port}"
            if isinstance(mode, mode_specs.RegularMode) and not ends.proxy:
                ends.proxy = url
            elif isinstance(mode, mode_specs.ReverseMode) and not ends.reverse and not self._is_control_mode(mode):
                ends.reverse = url
        return ends

    def _is_control_mode(self, mode) -> bool:
        return isinstance(mode, mode_specs.ReverseMode) and mode.data == f"http://{ctx.options.stepmill_control_host}"

    def _credential_tags(self, value: str | None) -> tagging.Tags | None:
        # With mitmproxy's own proxyauth, proxy credentials are a login: never tags, never stored.
        return None if ctx.options.proxyauth else tagging.from_proxy_authorization(value)

    # -- hooks ----------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow):
        tags = self._credential_tags(flow.request.headers.get("proxy-authorization"))
        if tags:
            self.connection_tags[flow.client_conn.id] = tags

    def client_disconnected(self, client):
        self.connection_tags.pop(client.id, None)

    def request(self, flow: http.HTTPFlow):
        """Synchronous for the common case; returns a coroutine (which mitmproxy awaits) only for the
        control API and for the first call to a host whose engine probe is still to be made."""
        try:
            if flow.response is not None:
                return None  # another addon answered already (mitmproxy's proxyauth: 407)
            if self._is_control(flow):
                return self._answer_control(flow)
            capture = self._request(flow)
            if capture is None or capture.websocket:
                return None
            native = engine.NATIVE_APIS.get(capture.call.api)  # an engine's own endpoint, e.g. SGLang's /generate
            if not ctx.options.stepmill_engine_inject and not native:
                return None
            decision = engine.configured(capture.call.host, flow.request.port, capture.call.api,
                                         ctx.options.stepmill_engine_hosts)
            if decision is None:
                key = self._probe_key(flow, capture)
                decision = self.probe.known(key)
                if decision is None:
                    return self._probe_then_inject(flow, capture, key)
            if native and decision not in (native, True):
                self._forget(flow, capture)  # some other service's /generate: not an LLM call of ours
            elif decision and ctx.options.stepmill_engine_inject:
                self._inject(flow, capture, decision)
        except Exception:
            hook_failed("request")
        return None

    def responseheaders(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if flow.response is None:
            return
        if capture is None:
            if "text/event-stream" in flow.response.headers.get("content-type", ""):
                flow.response.stream = True  # other event streams pass through as they come, not buffered
            return
        try:
            if "text/event-stream" in flow.response.headers.get("content-type", ""):
                rewrite = translate = None
                if capture.added and ctx.options.stepmill_engine_strip:
                    rewrite = lambda payload: engine.strip(payload, capture.added)  # noqa: E731
                if capture.translated is not None:
                    translate = messages_via_chat.StreamTranslator(**capture.translated)
                capture.tap = StreamTap(rewrite=rewrite, markers=engine.MARKERS, translate=translate,
                                        translate_end=translate.close if translate else None,
                                        content_encoding=flow.response.headers.get("content-encoding"),
                                        limit=ctx.options.stepmill_max_body)
                if capture.tap.rewriting and "content-encoding" in flow.response.headers:
                    del flow.response.headers["content-encoding"]  # rewritten events go out decoded
                flow.response.stream = capture.tap
        except Exception:
            hook_failed("responseheaders")

    def response(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.done or flow.response is None:
            return
        if capture.websocket and flow.response.status_code == 101:
            capture.done = True
            self._settled(capture.call.tags.trajectory_id)  # the turns are steps, counted as they come
            return
        try:
            self._finish(flow, capture, error=None)
        except Exception as exc:
            hook_failed("response")
            self._submit_failure(capture, f"stepmill could not record this call: {exc}", flow)

    def error(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or capture.done or flow.websocket is not None:
            return
        try:
            self._finish(flow, capture, error=flow.error.msg if flow.error else "connection failed")
        except Exception as exc:
            hook_failed("error")
            self._submit_failure(capture, f"stepmill could not record this call: {exc}", flow)

    # -- HTTP ------------------------------------------------------------------------------
    def _is_control(self, flow: http.HTTPFlow) -> bool:
        mode = flow.client_conn.proxy_mode
        if self._is_control_mode(mode):
            return True  # the --control-port listener
        # Through the proxy, as plain http://stepmill.local/... (never on another host or a reverse port).
        return isinstance(mode, mode_specs.RegularMode) and flow.request.scheme == "http" \
            and flow.request.host == ctx.options.stepmill_control_host

    def _request(self, flow: http.HTTPFlow) -> Capture | None:
        request = flow.request
        tagged = tagging.split_tag_path(request.path)
        api_path = tagged[1] if tagged else request.path
        found = match(api_path)
        if found is None:
            return None  # not an LLM call: untouched
        host = request.pretty_host
        hosts = {h.strip() for value in ctx.options.stepmill_hosts for h in value.split(",") if h.strip()}
        if hosts and host not in hosts:
            return None
        api, module = found
        index = tagging.header_index(request.headers)
        websocket = request.method == "GET" and index.get("upgrade", "").lower() == "websocket"
        if request.method != "POST" and not (websocket and module is openai_responses):
            return None
        # An LLM call: from here on the request may be changed (tags taken out, engine fields added).
        path_tags = None
        if tagged:
            path_tags, request.path = tagged
        headers = tagging.pop_header_tags(request.headers, index)
        request_tags = None
        if not ctx.options.proxyauth and "proxy-authorization" in index:
            request_tags = self._credential_tags(index["proxy-authorization"])
            request.headers.pop("proxy-authorization", None)  # hop-by-hop: its secret never goes upstream
        try:
            credential = self.runs.credential(path_tags, self.connection_tags.get(flow.client_conn.id), request_tags)
            tags = self.runs.resolve(credential, headers)
        except Refused as exc:
            log.warning(f"stepmill: refused {request.method} {host}{api_path}: {exc}")
            flow.response = http.Response.make(403, recording.json_bytes({"error": {
                "message": f"stepmill refused this call: {exc}", "type": "stepmill_refused"}}),
                {"Content-Type": "application/json"})
            return None
        capture = Capture(
            call=Call(api=api, host=host, path=request.path.split("?", 1)[0], tags=tags,
                      session_id=tagging.session_id(index), headers=secrets.allowed_headers(index),
                      client_conn=flow.client_conn.id, default_channel=ctx.options.stepmill_channel),
            started=request.timestamp_start or time.time(), raw_request=request.raw_content or b"",
            request_encoding=index.get("content-encoding"), websocket=websocket,
        )
        flow.metadata["stepmill"] = capture
        self.inflight[tags.trajectory_id] += 1  # until handed off, or (a WebSocket) upgraded
        return capture

    @staticmethod
    def _via(flow: http.HTTPFlow) -> tuple | None:
        """The upstream proxy this flow goes through: one a script set on the flow, else the mode's."""
        if flow.server_conn.via is not None:  # a ServerSpec: (scheme, (host, port))
            scheme, address = flow.server_conn.via
            return scheme, tuple(address)
        mode = flow.client_conn.proxy_mode
        if isinstance(mode, mode_specs.UpstreamMode):
            return mode.scheme, mode.address
        return None

    def _forget(self, flow: http.HTTPFlow, capture: Capture) -> None:
        """A call that turned out not to be one to record: no step, nothing waits for it."""
        flow.metadata.pop("stepmill", None)
        capture.done = True
        self._settled(capture.call.tags.trajectory_id)

    @classmethod
    def _probe_key(cls, flow: http.HTTPFlow, capture: Capture) -> tuple:
        request = flow.request
        bare = request.path.split("?", 1)[0].rstrip("/")
        if bare.endswith("/generate"):  # SGLang's native endpoint sits beside /v1
            root = bare[: -len("/generate")] + "/v1"
        elif bare.endswith("/chat/completions"):
            root = bare[: -len("/chat/completions")]
        else:
            root = bare.rsplit("/", 1)[0]
        return request.scheme, request.host, request.port, capture.call.host, root, cls._via(flow)

    async def _probe_then_inject(self, flow: http.HTTPFlow, capture: Capture, key: tuple) -> None:
        try:
            request = flow.request
            auth = {k: v for k, v in request.headers.items() if k.lower() in ENGINE_AUTH_HEADERS}
            answer = await self.probe.ask(key, request.scheme, (request.host, request.port),
                                          request.host_header or request.host, key[4] + "/models", auth,
                                          self._upstream_ssl(), via=self._via(flow))
            native = engine.NATIVE_APIS.get(capture.call.api)
            if native and answer != native:
                self._forget(flow, capture)
            elif answer and ctx.options.stepmill_engine_inject:
                self._inject(flow, capture, answer)
        except Exception:
            hook_failed("request")

    def _inject(self, flow: http.HTTPFlow, capture: Capture, kind: str | bool = True) -> None:
        """Only requests to engines are parsed on the loop: the fields must be added before bytes move."""
        request = flow.request
        try:
            body = json.loads(request.get_content(strict=False) or b"")
        except (ValueError, RecursionError):
            return  # the writer records it as the malformed request it is
        if not isinstance(body, dict):
            return
        if capture.call.api == anthropic_messages.API:
            self._messages_via_chat(flow, capture, body, kind)
            return
        capture.added = engine.inject(body, capture.call.api, "sglang" if kind == "sglang" else "vllm")
        if capture.added:
            request.set_content(recording.json_bytes(body))

    @staticmethod
    def _messages_via_chat(flow: http.HTTPFlow, capture: Capture, body: dict, kind: str | bool) -> None:
        """The engine's chat completions, asked for ids, in place of its /v1/messages: the step records
        the chat exchange (exact ids); the agent gets it back as Messages."""
        request = flow.request
        path = request.path.split("?", 1)[0]
        if kind != "sglang":  # vLLM renders with its own template through /tokenize, at its root
            capture.render_with = f"{request.scheme}://{request.host}:{request.port}{path[: -len('/v1/messages')]}"
        if not ctx.options.stepmill_messages_via_chat:
            capture.notes.append("stepmill_messages_via_chat is off: the engine's /v1/messages gives no token ids")
            return
        try:
            chat = messages_via_chat.request_to_chat(body, engine="sglang" if kind == "sglang" else "vllm")
        except messages_via_chat.Untranslatable as exc:
            capture.notes.append(f"sent to the engine's /v1/messages as it came, which gives no token ids ({exc})")
            return
        capture.render_with = None  # served through chat: exact ids
        request.path = path[: -len("/messages")] + "/chat/completions"
        request.set_content(recording.json_bytes(chat))
        capture.raw_request = request.raw_content or b""
        capture.call.api, capture.call.path = openai_chat.CHAT, request.path
        capture.translated = {"model": body.get("model"), "stop_sequences": body.get("stop_sequences")}
        capture.notes.append("an Anthropic Messages call, served through the engine's chat completions for "
                             "exact token ids; the agent got the answer as Messages")

    @staticmethod
    def _upstream_ssl() -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=ctx.options.ssl_verify_upstream_trusted_ca or None)
        if ctx.options.ssl_insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def _finish(self, flow: http.HTTPFlow, capture: Capture, *, error: str | None) -> None:
        response = flow.response
        header = self._header(capture, "sse" if capture.tap is not None else "http")
        header.update(error=error, ended=(response.timestamp_end if response and response.timestamp_end else None)
                      or time.time(), http_status=response.status_code if response is not None else None,
                      websocket_upgrade=capture.websocket, max_body=ctx.options.stepmill_max_body)
        if capture.tap is not None:
            header.update(marks=capture.tap.marks, response_encoding=capture.tap.content_encoding,
                          notes=capture.notes + capture.tap.notes, received=capture.tap.received)
            self._submit(capture, header, [capture.raw_request, capture.tap.raw])
            return
        body = (response.raw_content or b"") if response is not None else b""
        header.update(response_started=response.timestamp_start if response is not None else None,
                      response_encoding=response.headers.get("content-encoding") if response is not None else None)
        if capture.added and ctx.options.stepmill_engine_strip and response is not None \
                and response.status_code < 400 and error is None:
            self._strip_plain(response, capture)
        if capture.translated is not None and response is not None:
            self._translate_plain(response, capture)
        header["notes"] = capture.notes
        self._submit(capture, header, [capture.raw_request, body])

    def _strip_plain(self, response: http.Response, capture: Capture) -> None:
        """An engine's whole body: the fields only stepmill asked for are taken out before it moves."""
        try:
            payload = json.loads(response.get_content(strict=False) or b"")
            if isinstance(payload, dict) and engine.strip(payload, capture.added):
                response.set_content(recording.json_bytes(payload))
        except Exception as exc:  # the agent gets the engine's body rather than none
            capture.notes.append(f"could not remove the engine fields: {exc}")

    def _translate_plain(self, response: http.Response, capture: Capture) -> None:
        """An engine's whole chat answer (or error) as the Messages answer the agent asked for."""
        try:
            payload = json.loads(response.get_content(strict=False) or b"")
            translated = messages_via_chat.chat_to_message(payload, **capture.translated) \
                if response.status_code < 400 else messages_via_chat.error_body(payload)
        except Exception as exc:
            capture.notes.append(f"could not translate the engine's answer to Messages: {exc}")
            translated = messages_via_chat.error_body({"message": f"stepmill could not translate the answer: {exc}"})
        response.set_content(recording.json_bytes(translated))
        response.headers["content-type"] = "application/json"

    def _header(self, capture: Capture, kind: str) -> dict:
        return {"kind": kind, **call_header(capture.call), "started": capture.started, "render_with": capture.render_with,
                "policy_version": self.policy_version, "keep_raw": ctx.options.stepmill_keep_raw,
                "request_encoding": capture.request_encoding}

    def _submit(self, capture: Capture, header: dict, blobs: list) -> None:
        capture.done = True
        self._handed_off(capture.call.tags.trajectory_id, header, blobs)

    def _handed_off(self, trajectory_id: str | None, header: dict, blobs: list) -> None:
        if self.handoff is not None:
            self.handoff.submit(header, blobs)
            self.submitted += 1
        self._settled(trajectory_id)

    def _settled(self, trajectory_id: str | None) -> None:
        """A call of ``trajectory_id`` is no longer in flight (handed off, upgraded or not ours)."""
        self.inflight[trajectory_id] -= 1
        if self.inflight[trajectory_id] <= 0:
            del self.inflight[trajectory_id]

    def _submit_failure(self, capture: Capture, message: str, flow: http.HTTPFlow):
        """Last resort for a hook that failed: keep the raw exchange with an error, so nothing is lost."""
        if capture.done:
            return
        raw_response = capture.tap.raw if capture.tap is not None else \
            ((flow.response.raw_content or b"") if flow.response is not None else b"")
        header = {"kind": "failure", **call_header(capture.call), "started": capture.started, "error": message,
                  "max_body": ctx.options.stepmill_max_body, "request_encoding": capture.request_encoding,
                  "response_encoding": capture.tap.content_encoding if capture.tap is not None else
                  flow.response.headers.get("content-encoding") if flow.response is not None else None,
                  "received": capture.tap.received if capture.tap is not None else None}
        self._submit(capture, header, [capture.raw_request, raw_response])

    # -- WebSocket (Responses) ----------------------------------------------------------------
    def websocket_message(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or flow.websocket is None:
            return
        try:
            message = flow.websocket.messages[-1]
            content = message.content
            if message.from_client:
                if not is_create_frame(content):
                    return  # other client frames (steering, pings, anything unparsable) do not end a turn
                pending = self.turns.pop(flow.id, None)
                if pending is not None:
                    self._finish_turn(capture, pending, cut="a new response.create arrived before this turn ended")
                self.turns[flow.id] = Turn(request=content, started=message.timestamp)
                self.inflight[capture.call.tags.trajectory_id] += 1
                return
            turn = self.turns.get(flow.id)
            if turn is None:
                return
            turn.frames.append((message.timestamp, content))
            if is_terminal_frame(content):
                self.turns.pop(flow.id, None)
                self._finish_turn(capture, turn)
        except Exception:
            hook_failed("websocket_message")

    def websocket_end(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        turn = self.turns.pop(flow.id, None)
        if capture is None or turn is None:
            return
        try:
            reason = flow.websocket.close_reason if flow.websocket else None
            self._finish_turn(capture, turn, cut=f"WebSocket closed before the turn ended"
                                                 f" (code {flow.websocket.close_code if flow.websocket else '?'}"
                                                 f"{', ' + reason if reason else ''})")
        except Exception:
            hook_failed("websocket_end")

    def _finish_turn(self, capture: Capture, turn: Turn, cut: str | None = None):
        header = self._header(capture, "websocket")
        header.update(started=turn.started, ended=time.time(), cut=cut,
                      frames=[[at, i + 1] for i, (at, _) in enumerate(turn.frames)])
        self._handed_off(capture.call.tags.trajectory_id, header, [turn.request] + [content for _, content in turn.frames])

    # -- control API ----------------------------------------------------------------------------
    async def _answer_control(self, flow: http.HTTPFlow):
        """Answered in the control thread: its reads and writes never hold up the loop. Completing a
        trajectory (and ``POST /v1/barrier``) first waits, here on the loop without blocking it, until
        every call of the trajectory (of all, for the barrier) has ended and the writer committed it."""
        request = flow.request
        try:
            waits = self.control.barrier_target(request.method, request.path, request.headers.get("authorization"))
            if waits is not False:
                flow.metadata["stepmill_barrier"] = await self._barrier(waits)
            status, payload = await asyncio.get_running_loop().run_in_executor(
                self.control_thread, lambda: self.control.handle(request.method, request.path,
                                                                 request.get_content(strict=False) or b"",
                                                                 authorization=request.headers.get("authorization"),
                                                                 barrier=flow.metadata.get("stepmill_barrier")))
        except Exception as exc:
            hook_failed("request")
            status, payload = 500, {"error": f"the control API failed: {exc}"}
        flow.response = http.Response.make(status, recording.json_bytes(payload), {"Content-Type": "application/json"})

    async def _barrier(self, trajectory_id: str | None) -> dict:
        """Waits until no call of ``trajectory_id`` (any call, for None) is in flight, every call handed
        off is in the journal, and the writer committed the journal up to where it then ended."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + BARRIER_TIMEOUT

        def inflight() -> int:
            return sum(self.inflight.values()) if trajectory_id is None else self.inflight.get(trajectory_id, 0)

        while inflight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(BARRIER_POLL)
        target = self.submitted
        handoff, journal, control = self.handoff, self.journal, self.control
        while handoff is not None and handoff.appended + handoff.dropped < target and time.monotonic() < deadline:
            await asyncio.sleep(BARRIER_POLL)
        end = journal.end() if journal is not None else None
        committed = False
        while end is not None and time.monotonic() < deadline:
            position = await loop.run_in_executor(self.control_thread, lambda: journal.committed(control.store))
            if position >= end:
                committed = True
                break
            await asyncio.sleep(BARRIER_POLL * 5)
        return {"committed": committed, "waited_ms": round((time.monotonic() - started) * 1000, 1),
                **({} if committed else {"in_flight": inflight()})}

