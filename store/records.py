"""What the capture side hands to the store for one LLM call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepRecord:
    api: str  # openai.chat | openai.completions | openai.responses | anthropic.messages | control
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
    channel: str | None = None
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
