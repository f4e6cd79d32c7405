"""Off the event loop, in the writer: from a parsed call to stored steps, never raising and never
losing the call.

Parsers see bodies of any shape (valid JSON with odd types, huge integers, lone surrogates), and
a write can fail after a good parse. Each layer here catches what the one before could not:
a full step, else an ``error`` step with what did parse and the raw bytes, else a bare
``error`` step built from nothing the call sent but its (redacted) raw bytes.
"""

from __future__ import annotations

import logging
import time

from stepmill.errors import StoreUnavailable
from stepmill.store import Store
from stepmill.store.ids import iso
from stepmill.store.records import StepRecord

from stepmill.protocols import Completion, ParsedRequest, Protocol, ProtocolError
from stepmill.protocols.base import load_json_object
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.redaction import redact_bytes, redact_json, redact_text

log = logging.getLogger("stepmill")
# The store raises StoreUnavailable when the file cannot be written now (not that this call is odd):
# it passes through every layer here, and the writer keeps the call in the journal and tries again
# later instead of recording it as a failure.


def parse_request(protocol: Protocol, raw: bytes) -> tuple[ParsedRequest | None, dict | None, str | None]:
    """(parsed request, JSON body, error). Never raises."""
    api = protocol.api
    try:
        body = load_json_object(raw, "request body")
    except ProtocolError as exc:
        return None, None, str(exc)
    except RecursionError:
        return None, None, "request body is nested too deeply to parse"
    try:
        return protocol.parse_request(body, api), body, None
    except Exception as exc:
        return None, body, f"request body does not have the {api} shape: {type(exc).__name__}: {exc}"


def parse_response(protocol: Protocol, payload: dict) -> Completion:
    """The completion of a whole (non-streamed) response body. Never raises."""
    api = protocol.api
    try:
        return protocol.parse_response(payload, api)
    except Exception as exc:
        response_id = payload.get("id") if isinstance(payload, dict) else None  # a JSON array has none
        return Completion(status="error", error=f"response body does not have the {api} shape: "
                                                f"{type(exc).__name__}: {exc}",
                          response_id=response_id if isinstance(response_id, str) else None)


def step_row(record: CallRecord, *, who: bool = True, **fields) -> StepRecord:
    """The one mapping of a call's record to its steps row: who made the call, where it went and when,
    and the writer's stamp; ``fields`` the rest (what parsed, or the error). ``who=False`` leaves out
    everything the call's tags and headers said (the last resort, when even they cannot be written)."""
    call = record.call
    row = {"api": str(call.api), "transport": record.transport, "started_at": iso(record.started)}
    if who:
        ended = record.ended or record.started
        row.update(
            engine_api=call.engine_api, host=call.host, path=call.path, headers=call.headers,
            trajectory_id=call.tags.trajectory_id, group_id=call.tags.group_id, channel=call.tags.channel,
            default_channel=call.default_channel, client_conn=call.client_conn, session_id=call.session_id,
            http_status=record.http_status, duration_ms=(ended - record.started) * 1000,
            ttft_ms=(record.response_started - record.started) * 1000 if record.response_started else None,
            policy_version=record.policy_version)
    row.update(fields)
    return StepRecord(**row)


def step_records(record: CallRecord, request: ParsedRequest | None, parse_error: str | None,
                 completion: Completion, messages: list, wire: list, *, notes: list[str],
                 raw_request: bytes | None, raw_response: bytes | None) -> list[StepRecord]:
    """One record per choice (n > 1 gives several rollouts of one prompt)."""
    choices = [completion] + list(completion.alternatives)
    keep_raw = record.keep_raw or bool(parse_error) or any(c.status != "ok" for c in choices) or bool(notes) \
        or bool(completion.notes)
    records = []
    for index, choice in enumerate(choices):
        metadata: dict = {"notes": notes} if notes and index == 0 else {}
        if len(choices) > 1:
            metadata["choice_index"] = index  # each choice is its own rollout of this prompt
        status, error = choice.status, choice.error
        if parse_error:  # a request that did not parse makes every choice of it an error
            status, error = "error", parse_error + (f"; {error}" if error else "")
        records.append(step_row(
            record,
            model=choice.model or (request.model if request else None),
            response_id=choice.response_id,
            params=redact_json(request.params) if request else {},
            tools=request.tools if request else None,
            messages=messages,
            wire_messages=wire,
            completion=choice.message,
            wire_completion=choice.wire,
            finish_reason=choice.finish_reason,
            usage=choice.usage,
            status=status,
            error=redact_text(error),
            session_id=record.call.session_id or (request.session_id if request else None),
            previous_response_id=request.previous_response_id if request else None,
            metadata=metadata or None,
            # The journal holds bodies the handoff redacted; what is kept raw is redacted once more all
            # the same: the last step before the database
            raw_request=redact_bytes(raw_request) if keep_raw and not index else None,
            raw_response=redact_bytes(raw_response) if keep_raw and not index else None,
            prompt_ids=choice.prompt_ids,
            response_ids=choice.response_ids,
            logprobs=choice.logprobs,
            token_provenance=choice.token_provenance or ("exact" if choice.response_ids is not None else None),
        ))
    return records


def record_call(store: Store, record: CallRecord, blobs: list[bytes], request: ParsedRequest | None,
                parse_error: str | None, completion: Completion, messages: list, wire: list) -> str:
    """Everything after the exchange: notes, records, the write with its fallbacks. Never raises."""
    raw_request, raw_response = record.raw_bodies(blobs)
    try:
        notes = list(completion.notes)
        if request is not None and request.prompt_ids is not None:  # token in: the ids the engine was given
            for choice in [completion, *completion.alternatives]:
                if choice.prompt_ids is None and choice.response_ids is not None:
                    choice.prompt_ids = request.prompt_ids
        if request is not None and request.previous_response_id and messages is request.messages:
            notes.append(f"previous_response_id {request.previous_response_id} was not seen by this proxy;"
                         " the conversation starts at this request")
        if completion.prompt_ids is None and completion.response_ids is not None:
            notes.append("the engine returned response ids without prompt ids")
        records = step_records(record, request, parse_error, completion, messages, wire, notes=notes,
                               raw_request=raw_request, raw_response=raw_response)
    except Exception as exc:
        return save_bare(store, record, blobs, f"stepmill could not read this call: {type(exc).__name__}: {exc}")
    return save(store, records, record, blobs)


def save(store: Store, records: list[StepRecord], record: CallRecord, blobs: list[bytes]) -> str:
    """Write the records (all or none); on failure keep the call as an error step. Returns which layer held."""
    try:
        store.record_steps(records)
        return "full"
    except StoreUnavailable:
        raise
    except Exception as exc:
        problem = f"stepmill could not record this call as parsed ({type(exc).__name__}: {exc})"
    log.warning(f"stepmill: kept a call as an error step: {problem}")
    first = records[0] if records else None
    raw_request, raw_response = record.raw_bodies(blobs)
    try:
        store.record_step(step_row(
            record, status="error", error=redact_text(problem),
            model=first.model if first else None, response_id=first.response_id if first else None,
            messages=first.messages if first else [], wire_messages=first.wire_messages if first else [],
            raw_request=redact_bytes(raw_request), raw_response=redact_bytes(raw_response)))
        return "parsed"
    except StoreUnavailable:
        raise
    except Exception as exc:
        problem += f"; keeping what parsed failed too ({type(exc).__name__}: {exc})"
    return save_bare(store, record, blobs, problem)


def save_bare(store: Store, record: CallRecord, blobs: list[bytes], problem: str) -> str:
    """Last resort: depends on nothing the call sent but its raw bytes, and on who made it (the flow's
    tags, never the parse) while that can be written; without them if even that fails."""
    raw_request, raw_response = record.raw_bodies(blobs)
    for who in (True, False):
        try:
            store.record_step(step_row(record, who=who, status="error", error=redact_text(problem),
                                       raw_request=redact_bytes(raw_request), raw_response=redact_bytes(raw_response)))
            return "bare"
        except StoreUnavailable:
            raise
        except Exception:
            if not who:
                log.exception("stepmill: could not record the failure either; the call is lost")
    return "lost"


def save_unreadable_entry(store: Store, problem: str, payload: bytes) -> str:
    """A journal entry that is no call record: an error step that says so, with the entry's raw bytes
    (nothing of it is trusted, so they are kept as they came, redacted)."""
    return save_bare(store, CallRecord(kind="failure", call=Call(api="unknown", host="", path=""), started=time.time()),
                     [bytes(payload)], problem)
