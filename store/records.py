"""What the capture side hands to the store for one LLM call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepRecord:
    api: str  # the protocol the agent spoke: a stepmill.protocols api (openai.chat, gemini.generate, …) or control
    transport: str = "http"  # http | sse | websocket
    host: str | None = None
    path: str | None = None
    model: str | None = None
    response_id: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # request parameters, conversation excluded
    tools: list | None = None
    messages: list[dict] = field(default_factory=list)  # full conversation, canonical form
    wire_messages: list = field(default_factory=list)  # full conversation, as the protocol carries it
    completion: dict | None = None  # canonical assistant message
    wire_completion: list = field(default_factory=list)  # the completion's wire items
    finish_reason: str | None = None
    usage: dict | None = None
    status: str = "ok"  # ok | error | incomplete
    error: str | None = None
    http_status: int | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None
    started_at: str | None = None
    headers: dict | None = None  # identifying request headers, secrets removed
    # Tagging, strongest first: explicit tags, the agent's own session id, a Responses chain.
    trajectory_id: str | None = None
    group_id: str | None = None
    session_id: str | None = None
    previous_response_id: str | None = None
    parent_step_id: str | None = None  # set by white-box submissions that know their parent
    channel: str | None = None  # explicit: it becomes the trajectory's channel
    default_channel: str | None = None  # for a new trajectory without an explicit one (the proxy's option)
    client_conn: str | None = None  # the agent's connection: concurrent identical rollouts stay apart
    policy_version: str | None = None
    reward: float | None = None
    step_index: int | None = None
    metadata: dict | None = None
    raw_request: bytes | None = None
    raw_response: bytes | None = None
    # Token ids, when the engine (or a white-box agent) gave them.
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    token_provenance: str | None = None  # exact | rendered | spliced | none
    is_last: bool = False
    # The protocol of the exchange kept (path, params, raw bodies), when the proxy served the agent's call through
    # another one (an engine's chat completions: openai.chat); None when it is the agent's own.
    engine_api: str | None = None


TOKEN_ID_LIMIT = 2**31  # ids are stored as int32


def _ids_problem(ids: Any) -> str | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)):
        return f"is a {type(ids).__name__}, not a list"
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < TOKEN_ID_LIMIT:
            return f"has {value!r} at position {i}, not a token id"
    return None


def check_record(rec: StepRecord) -> list[str]:
    """Drop optional fields that cannot be stored as they are (token ids, logprobs), keeping the
    rest of the step; returns a note for each thing dropped."""
    notes = []
    for name in ("prompt_ids", "response_ids"):
        problem = _ids_problem(getattr(rec, name))
        if problem:
            notes.append(f"{name} {problem}; the engine's ids were not kept")
            rec.prompt_ids = rec.response_ids = rec.logprobs = None
            rec.token_provenance = None
            break
    if rec.logprobs is not None:
        values = rec.logprobs
        if not isinstance(values, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            notes.append("logprobs are not a list of numbers; they were not kept")
            rec.logprobs = None
        elif len(values) != len(rec.response_ids or []):
            notes.append(f"logprobs has {len(values)} values for {len(rec.response_ids or [])} response ids;"
                         " they were not kept")
            rec.logprobs = None
    if rec.messages is not None and not (isinstance(rec.messages, list)
                                         and all(isinstance(m, dict) for m in rec.messages)):
        notes.append("the conversation is not a list of messages; it was not kept")
        rec.messages = []
    if rec.completion is not None and not isinstance(rec.completion, dict):
        notes.append("the completion is not a message object; it was not kept")
        rec.completion = None
    return notes
