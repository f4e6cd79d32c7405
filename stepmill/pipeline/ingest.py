"""Off the event loop, in the writer (a thread or its own process): a finished exchange, as the
proxy kept it, becomes step records.

The proxy hands over bytes and a few facts (a ``CallRecord``: who, when, which tags), and the
handoff decoded and redacted the bodies before the journal: they arrive here plain, and are never
decoded again. Everything else happens here: parsing each protocol, reassembling streams and
WebSocket turns, resolving Responses chains, and the write with its fallbacks.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable

from stepmill.errors import StoreUnavailable
from stepmill.store import Store
from stepmill.protocols import Completion, ParsedRequest, Protocol, ProtocolError, by_api, registry
from stepmill.protocols.base import load_json_object
from stepmill.protocols.streams import assemble
from stepmill.pipeline import engine_render
from stepmill.pipeline import recording
from stepmill.pipeline.call_record import Call, CallRecord

log = logging.getLogger("stepmill")


class Ingest:
    def __init__(self, store: Store):
        self.store = store
        registry.load()  # the protocols, entry points included (a scan of every installed package): before any call
        # Responses that primed a WebSocket (generate: false) are no steps, but later turns chain to them.
        self.warmups: OrderedDict[str, tuple[list, list]] = OrderedDict()
        self.unreadable = 0  # calls kept as error steps because reading them raised (a parser's bug)

    def handle(self, record: CallRecord, blobs: list[bytes]) -> str:
        """Record one finished exchange (both halves at once)."""
        return self.prepare(record, blobs)()

    def prepare(self, record: CallRecord, blobs: list[bytes]) -> Callable[[], str]:
        """The CPU-heavy half (parsing, reassembling), done outside any transaction; returns the other
        half, the write (linking, chains, SQLite), for the writer's transaction. Neither raises but for
        the store's environment (locked, full): a call that cannot be read is an error step."""
        try:
            if record.kind == "websocket":
                write = self._turn(record, blobs)
            elif record.kind == "failure":
                problems = [record.error or "stepmill failed", *record.truncated,
                            record.request_problem, record.response_problem]
                write = functools.partial(recording.save_bare, self.store, record, blobs,
                                          "; ".join(p for p in problems if p))
            else:
                write = self._http(record, blobs)
        except Exception as exc:
            return functools.partial(self._unreadable, record, blobs, exc)
        return functools.partial(self._write, write, record, blobs)

    def _write(self, write: Callable[[], str], record: CallRecord, blobs: list[bytes]) -> str:
        try:
            return write()
        except StoreUnavailable:  # the file takes no writes now: the call stays in the journal
            raise
        except Exception as exc:
            return self._unreadable(record, blobs, exc)

    def _unreadable(self, record: CallRecord, blobs: list[bytes], exc: Exception) -> str:
        self.unreadable += 1
        log.warning(f"stepmill: could not read a call to {record.call.host}{record.call.path} "
                    f"({type(exc).__name__}: {exc}); kept as an error step")
        return recording.save_bare(self.store, record, blobs,
                                   f"stepmill could not read this call: {type(exc).__name__}: {exc}")

    def unreadable_entry(self, problem: str, payload: bytes) -> str:
        """A journal entry that is no call record (nothing in it is trusted): an error step that says why,
        with the entry's raw bytes."""
        self.unreadable += 1
        log.warning(f"stepmill: could not read a journal entry ({problem}); kept as an error step")
        return recording.save_unreadable_entry(self.store, f"stepmill could not read this journal entry: {problem}",
                                               payload)

    def poison_entry(self, payload: bytes, exc: BaseException) -> str:
        """An entry whose commit raised even alone in its transaction (``writer._commit_split``): one error
        step that says why, kept as who made the call (where its header can be read) with its raw bodies."""
        self.unreadable += 1
        problem = f"stepmill could not store this call: {type(exc).__name__}: {str(exc)[:500]}"
        log.warning(f"stepmill: {problem}; kept as an error step")
        try:
            record, blobs = CallRecord.from_entry(payload)
        except Exception:
            return recording.save_unreadable_entry(self.store, problem, payload)
        return recording.save_bare(self.store, record, blobs, problem)

    # -- HTTP and SSE -----------------------------------------------------------------------
    @staticmethod
    def _protocol(call: Call) -> Protocol:
        """The protocol of the kept bodies: the engine's for a call served through its chat completions."""
        protocol = by_api(call.wire_api)
        if protocol is None:
            raise ProtocolError(f"no protocol {call.wire_api!r} is installed (an entry point of stepmill.protocols)")
        return protocol

    def _http(self, record: CallRecord, blobs: list[bytes]) -> Callable[[], str]:
        call = record.call
        protocol = self._protocol(call)
        api = protocol.api
        raw_request, raw_response = blobs[0], blobs[1] if len(blobs) > 1 else b""
        request, body, parse_error = None, None, record.request_problem  # the handoff could not decode it
        if record.websocket_upgrade:
            parse_error = None  # a refused upgrade: the GET has no body to parse
        elif not parse_error:
            request, body, parse_error = recording.parse_request(protocol, raw_request)
            if request is not None and protocol.from_path is not None:  # a protocol that names the model in the path
                protocol.from_path(request, call.path)
        error = record.error
        if record.kind == "sse":
            result = assemble(protocol.StreamAssembler(api), raw_response, record.marks or [], None, protocol.split)
            completion = result.completion
            if error and not result.terminal:
                # Clients close (or reset an HTTP/2 stream) right after the last event: only a stream
                # cut before its terminal event is incomplete.
                completion.status = "incomplete"
                completion.error = f"{error} (stream cut after {len(raw_response)} bytes)"
            if record.response_problem:
                completion.status = "error"
                completion.error = "; ".join(e for e in (record.response_problem, completion.error) if e)
            record.response_started = result.first_output_at
        else:
            status = record.http_status
            if error and status is None:
                completion = Completion(status="error", error=error)
            elif status is not None and status >= 400:
                completion = Completion(status="error", error=f"upstream answered {status}: "
                                        f"{raw_response[:2000].decode('utf-8', 'replace')}")
            elif record.response_problem:
                completion = Completion(status="error", error=record.response_problem)
            else:
                try:
                    payload = protocol.load_response(raw_response, "response body")
                except ProtocolError as exc:  # a body cut by the connection's end says so first
                    completion = Completion(status="error", error="; ".join(e for e in (error, str(exc)) if e))
                else:
                    completion = recording.parse_response(protocol, payload)
            if error and status is not None and completion.status == "ok":
                completion.status, completion.error = "incomplete", error
        if record.truncated:  # cut for recording (stepmill_max_body): what was kept is not the whole call
            cut = "; ".join(record.truncated)
            if completion.status == "ok":
                completion.status = "incomplete"
            completion.error = f"{cut}; {completion.error}" if completion.error else cut
        completion.notes = list(completion.notes) + list(record.notes)
        if record.render_with and body is not None and completion.status == "ok" \
                and completion.response_ids is None:
            try:  # a network call, here before the transaction, never inside it
                completion.prompt_ids, completion.response_ids, note = engine_render.render(
                    record.render_with, body, completion.wire)
                completion.token_provenance = "rendered"
                completion.notes.append(note)
            except Exception as exc:
                completion.notes.append(f"the engine could not render ids ({type(exc).__name__}: {exc})")

        def write() -> str:
            messages, wire = self.resolve_chain(request) if request is not None else ([], [])
            return recording.record_call(self.store, record, blobs, request, parse_error, completion, messages, wire)
        return write

    # -- WebSocket turns ------------------------------------------------------------------------
    def _turn(self, record: CallRecord, blobs: list[bytes]) -> Callable[[], str]:
        request, parse_error = None, None
        protocol = self._protocol(record.call)  # Responses: the one protocol with WebSocket turns
        try:
            payload = load_json_object(blobs[0], "response.create frame")
            request = protocol.parse_request(payload, protocol.api)
        except Exception as exc:
            parse_error = f"response.create does not have the Responses shape: {type(exc).__name__}: {exc}"
        assembler = protocol.StreamAssembler(protocol.api)
        for at, index in record.frames:  # (time, blob index) of the server frames; blob 0 is the request
            try:
                assembler.feed(None, blobs[index].decode("utf-8", "replace"))
            except Exception as exc:
                assembler.notes.append(f"unparsed frame {blobs[index][:200]!r}: {exc}")
            if record.response_started is None and assembler.output_started:
                record.response_started = at
        completion = assembler.finish()
        cut = record.cut
        if cut and completion.status == "ok":
            completion.status, completion.error = "incomplete", cut
        elif cut:
            completion.error = f"{completion.error}; {cut}" if completion.error else cut

        def write() -> str:
            if request is not None and not request.generate:
                if completion.response_id:
                    messages, wire = self.resolve_chain(request)
                    self.warmups[completion.response_id] = (messages, wire + list(completion.wire))
                    while len(self.warmups) > 1024:
                        self.warmups.popitem(last=False)
                return "warmup"
            messages, wire = self.resolve_chain(request) if request is not None else ([], [])
            return recording.record_call(self.store, record, blobs, request, parse_error, completion, messages, wire)
        return write

    def resolve_chain(self, request: ParsedRequest) -> tuple[list, list]:
        """The full conversation of a Responses request that names its previous response."""
        if not request.previous_response_id:
            return request.messages, request.wire_messages
        base = self.warmups.get(request.previous_response_id)
        if base is None:
            step_id = self.store.step_for_response(request.previous_response_id)
            base = self.store.continuation(step_id) if step_id else None
        if base is None:
            return request.messages, request.wire_messages
        base_messages, base_wire = base
        system = [m for m in request.messages[:1] if m.get("role") == "system"]
        history = base_messages[1:] if base_messages and base_messages[0].get("role") == "system" else base_messages
        return system + list(history) + request.messages[len(system):], list(base_wire) + list(request.wire_messages)


__all__ = ["Ingest"]
