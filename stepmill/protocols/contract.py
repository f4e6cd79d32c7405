"""What a wire protocol provides, typed: one ``Protocol`` value per API, which its module names ``PROTOCOL``.

Everything that handles calls (the addon on the event loop, the writer, tokenize, the UI) reads a protocol
through this record, never through a module's attributes or a test of its api name: a protocol written in
another package (registered through the ``stepmill.protocols`` entry points, ``registry``) is handled the
same way as the built-in ones.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from stepmill.protocols.base import Completion, ParsedRequest, load_json_object
from stepmill.protocols.sse import events_of

ENGINE_IDS = ("chat", "completions", "responses", "generate")  # how engine.inject asks an engine for ids


class StreamAssembler(typing.Protocol):
    """Rebuilds one completion from a stream's chunks (``StreamAssembler(api)``), in the writer."""

    notes: list[str]  # what did not parse cleanly
    output_started: bool  # an event with output arrived (its time is the time to first token)

    @property
    def terminal(self) -> bool:
        """The stream's last event arrived: a connection closed after it is no cut."""

    def feed(self, event: str | None, data: str) -> None:
        """One event whose data did not parse as JSON (the assembler says why, or handles it: ``[DONE]``)."""

    def feed_parsed(self, event: str | None, chunk: Any) -> None:
        """One event, its data already parsed."""

    def finish(self) -> Completion:
        """The completion of the events fed so far."""


@dataclass
class Translated:
    """A call translated to an engine's chat completions."""

    chat: dict  # the chat completions request, asking for ids
    path: str  # where the engine's chat completions are
    options: dict  # what the translation's ``answer_of`` and ``StreamTranslator`` take
    notes: list[str] = field(default_factory=list)  # what the chat request could not carry


class ChatTranslation(typing.Protocol):
    """A protocol served through an engine's chat completions, for exact ids (a module:
    ``messages_via_chat``, ``gemini_via_chat``). On the event loop: pure functions, no I/O."""

    # The engine serves the protocol itself, without ids (vLLM's and SGLang's /v1/messages): the translation can be
    # turned off (stepmill_messages_via_chat), and a call it cannot carry goes there as it came (for Messages the
    # writer then asks vLLM's /tokenize for rendered ids: pipeline.engine_render).
    ENGINE_ENDPOINT: bool
    NOTE: str  # what a translated step says of itself (metadata.notes)

    def chat_path(self, path: str) -> str:
        """The engine's chat completions path beside the agent's path."""

    def translate(self, body: dict, path: str, engine: str) -> Translated:
        """The request for the engine (``engine``: vllm or sglang), with a note for each part of it the chat
        request does not carry; raises when chat cannot carry the call at all."""

    def answer_of(self, payload: dict, **options) -> Any:
        """The engine's whole chat answer as the agent's protocol answers."""

    def error_body(self, payload: Any, status: int | None = None) -> dict:
        """An engine's error as the agent's protocol says one (``status``: the HTTP status it came with)."""

    # chat chunks in, the agent's stream out (a ``via_chat.ChatStreamTranslator``), given what ``translate`` said
    StreamTranslator: Callable[..., Callable]


Split = Callable[[bytes], Iterator[tuple[int, str | None, str]]]  # a stream's events: (end offset, name, data)


@dataclass(frozen=True)
class Protocol:
    """One LLM API as stepmill records it."""

    api: str  # the name steps carry: "openai.chat", "gemini.generate"
    path: re.Pattern  # searched in a request path (no query, no trailing slash); a str is compiled
    parse_request: Callable[[dict, str], ParsedRequest]  # (JSON body, api) → canonical request
    parse_response: Callable[[Any, str], Completion]  # (what load_response gave, api) → completion
    StreamAssembler: Callable[[str], StreamAssembler]  # StreamAssembler(api)
    # Optional hooks
    load_response: Callable[[bytes, str], Any] = load_json_object  # (body, what) → parse_response's input
    from_path: Callable[[ParsedRequest, str], None] | None = None  # what the path says (a model named in it)
    split: Split = events_of  # a stream's events: SSE unless the protocol streams otherwise
    streamed_path: Callable[[str], bool] | None = None  # a path whose JSON answer is a stream (a JSON array)
    websocket: bool = False  # a WebSocket upgrade on its path is a call too (Responses)
    # Engines (vLLM, SGLang)
    engine_ids: str | None = None  # how an engine is asked for ids in the request: one of ENGINE_IDS
    engine_native: str | None = None  # the engine whose own endpoint this is ("sglang"): recorded only there
    via_chat: ChatTranslation | None = None  # served through an engine's chat completions for exact ids
    prompt_is_text: bool = False  # the prompt is text, not a conversation (completions): no chat template

    def __post_init__(self):
        if isinstance(self.path, str):
            object.__setattr__(self, "path", re.compile(self.path))
        if not isinstance(self.api, str) or not self.api:
            raise TypeError(f"a protocol's api is a non-empty string, not {self.api!r}")
        if not isinstance(self.path, re.Pattern):
            raise TypeError(f"{self.api}: path is a regular expression, not {self.path!r}")
        for name in ("parse_request", "parse_response", "StreamAssembler", "load_response", "split"):
            if not callable(getattr(self, name)):
                raise TypeError(f"{self.api}: {name} is not callable")
        for name in ("from_path", "streamed_path"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{self.api}: {name} is not callable")
        if self.engine_ids is not None and self.engine_ids not in ENGINE_IDS:
            raise TypeError(f"{self.api}: engine_ids is one of {', '.join(ENGINE_IDS)} or None, "
                            f"not {self.engine_ids!r}")

    def matches(self, bare_path: str) -> bool:
        return self.path.search(bare_path) is not None

    def streams_json(self, path: str) -> bool:
        """A call whose answer streams as a JSON array, not as events (Gemini's without ?alt=sse)."""
        return self.streamed_path is not None and self.streamed_path(path)

    @property
    def asks_engines(self) -> bool:
        """Engines are asked for ids on this protocol's calls (itself, or through their chat)."""
        return self.engine_ids is not None or self.via_chat is not None
