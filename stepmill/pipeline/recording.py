"""Off the event loop, in the writer: from a parsed call to stored steps, never raising and never
losing the call.

Parsers see bodies of any shape (valid JSON with odd types, huge integers, lone surrogates), and
a write can fail after a good parse. Each layer here catches what the one before could not:
a full step, else an ``error`` step with what did parse and the raw bytes, else a bare
``error`` step built from nothing the call sent but its (redacted) raw bytes.
"""

from __future__ import annotations

import logging

from stepmill.errors import StoreUnavailable
from stepmill.store import Store
from stepmill.store.ids import iso
from stepmill.store.records import StepRecord

from stepmill.protocols import Completion, ParsedRequest, Protocol, ProtocolError
from stepmill.protocols.base import load_json_object
from stepmill.pipeline.call_record import Call
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


def step_records(call: Call, request: ParsedRequest | None, parse_error: str | None, completion: Completion,
                 messages: list, wire: list, *, notes: list[str], transport: str, started: float, ended: float,
                 ttft_ms: float | None, http_status: int | None, policy_version: str | None, keep_raw: bool,
                 raw_request: bytes | None, raw_response: bytes | None) -> list[StepRecord]:
    """One record per choice (n > 1 gives several rollouts of one prompt)."""
    choices = [completion] + list(completion.alternatives)
    keep_raw = keep_raw or bool(parse_error) or any(c.status != "ok" for c in choices) or bool(notes) \
        or bool(completion.notes)
    records = []
    for index, choice in enumerate(choices):
        metadata: dict = {"notes": notes} if notes and index == 0 else {}
        if len(choices) > 1:
            metadata["choice_index"] = index  # each choice is its own rollout of this prompt
        status, error = choice.status, choice.error
        if parse_error:  # a request that did not parse makes every choice of it an error
            status, error = "error", parse_error + (f"; {error}" if error else "")
        records.append(StepRecord(
            api=call.api,
            engine_api=call.engine_api,
            transport=transport,
            host=call.host,
            path=call.path,
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
            http_status=http_status,
            ttft_ms=ttft_ms,
            duration_ms=(ended - started) * 1000,
            started_at=iso(started),
            headers=call.headers,
            trajectory_id=call.tags.trajectory_id,
            group_id=call.tags.group_id,
            channel=call.tags.channel,
            default_channel=call.default_channel,
            client_conn=call.client_conn,
            session_id=call.session_id or (request.session_id if request else None),
            previous_response_id=request.previous_response_id if request else None,
            policy_version=policy_version,
            metadata=metadata or None,
            raw_request=redact_bytes(raw_request) if keep_raw and not index else None,
            raw_response=redact_bytes(raw_response) if keep_raw and not index else None,
            prompt_ids=choice.prompt_ids,
            response_ids=choice.response_ids,
            logprobs=choice.logprobs,
            token_provenance=choice.token_provenance or ("exact" if choice.response_ids is not None else None),
        ))
    return records


def record_call(store: Store, call: Call, request: ParsedRequest | None, parse_error: str | None,
                completion: Completion, messages: list, wire: list, *, transport: str, started: float, ended: float,
                ttft_ms: float | None, http_status: int | None, policy_version: str | None, keep_raw: bool,
                raw_request: bytes | None, raw_response: bytes | None) -> str:
    """Everything after the exchange: notes, records, the write with its fallbacks. Never raises."""
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
        records = step_records(call, request, parse_error, completion, messages, wire, notes=notes,
                               transport=transport, started=started, ended=ended, ttft_ms=ttft_ms,
                               http_status=http_status, policy_version=policy_version, keep_raw=keep_raw,
                               raw_request=raw_request, raw_response=raw_response)
    except Exception as exc:
        return save_bare(store, call.api, f"stepmill could not read this call: {type(exc).__name__}: {exc}",
                         started=started, transport=transport, raw_request=raw_request, raw_response=raw_response,
                         call=call)
    return save(store, records, call, started=started, transport=transport, raw_request=raw_request,
                raw_response=raw_response)


def save(store: Store, records: list[StepRecord], call: Call, *, started: float, transport: str,
         raw_request: bytes | None, raw_response: bytes | None) -> str:
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
    try:
        store.record_step(StepRecord(
            api=call.api, engine_api=call.engine_api, transport=transport, host=call.host, path=call.path,
            status="error",
            error=redact_text(problem), started_at=iso(started), headers=call.headers,
            model=first.model if first else None, response_id=first.response_id if first else None,
            messages=first.messages if first else [], wire_messages=first.wire_messages if first else [],
            trajectory_id=call.tags.trajectory_id, group_id=call.tags.group_id, channel=call.tags.channel,
            default_channel=call.default_channel, client_conn=call.client_conn,
            raw_request=redact_bytes(raw_request), raw_response=redact_bytes(raw_response),
        ))
        return "parsed"
    except StoreUnavailable:
        raise
    except Exception as exc:
        problem += f"; keeping what parsed failed too ({type(exc).__name__}: {exc})"
    return save_bare(store, call.api, problem, started=started, transport=transport, raw_request=raw_request,
                     raw_response=raw_response, call=call)


def save_bare(store: Store, api: str, problem: str, *, started: float, transport: str,
              raw_request: bytes | None, raw_response: bytes | None, call: Call | None = None) -> str:
    """Last resort: depends on nothing the call sent but its raw bytes, and on who made it (the flow's
    tags, never the parse) while that can be written; without them if even that fails."""
    for who in ((call, None) if call is not None else (None,)):
        try:
            store.record_step(StepRecord(
                api=str(api), transport=transport, status="error", error=redact_text(problem),
                started_at=iso(started), raw_request=redact_bytes(raw_request), raw_response=redact_bytes(raw_response),
                **({} if who is None else {
                    "host": who.host, "path": who.path, "headers": who.headers, "engine_api": who.engine_api,
                    "trajectory_id": who.tags.trajectory_id, "group_id": who.tags.group_id,
                    "channel": who.tags.channel, "default_channel": who.default_channel,
                    "client_conn": who.client_conn})))
            return "bare"
        except StoreUnavailable:
            raise
        except Exception:
            if who is None:
                log.exception("stepmill: could not record the failure either; the call is lost")
    return "lost"
