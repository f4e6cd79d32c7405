"""OpenAI Chat Completions (/v1/chat/completions) and legacy Completions (/v1/completions).

Also reads the token ids and logprobs that open-model engines add: vLLM's (and SGLang's)
``prompt_token_ids`` / ``token_ids``, SGLang's ``sglext.input_ids`` / ``sglext.output_ids`` (one
list per choice; streamed, in one final ``choices: []`` chunk), logprobs per token.
"""

from __future__ import annotations

import json
from typing import Any

from stepmill.protocols.base import (AssistantBuilder, Completion, DoneTerminatedStream, ParsedRequest, ProtocolError,
                                     canonical_content, tool_call, usage_of)
from stepmill.protocols.contract import Protocol

CHAT = "openai.chat"
COMPLETIONS = "openai.completions"


def _usage(raw):
    return usage_of(raw, input_key="prompt_tokens", output_key="completion_tokens",
                    cache_read=("prompt_tokens_details", "cached_tokens"))


def reasoning_of(message: dict) -> str | None:
    """A chat message's (or stream delta's) reasoning: vLLM and SGLang name the field either way."""
    return message.get("reasoning_content") or message.get("reasoning")


def canonical_message(message: dict) -> dict:
    role = message.get("role")
    role = {"developer": "system", "function": "tool"}.get(role, role)
    out: dict[str, Any] = {"role": role, "content": canonical_content(message.get("content"))}
    calls = []
    for call in message.get("tool_calls") or []:
        if call.get("type") == "custom" or "custom" in call:
            custom = call.get("custom") or {}
            calls.append(tool_call(call.get("id"), custom.get("name"), custom.get("input") or ""))
        else:
            fn = call.get("function") or {}
            calls.append(tool_call(call.get("id"), fn.get("name"), fn.get("arguments") or ""))
    if message.get("function_call"):
        fn = message["function_call"]
        calls.append(tool_call(None, fn.get("name"), fn.get("arguments") or ""))
    if calls:
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name") and role in ("tool", "user"):
        out["name"] = message["name"]
    reasoning = reasoning_of(message)
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def parse_request(body: dict, api: str = CHAT) -> ParsedRequest:
    if api == COMPLETIONS:
        if "prompt" not in body:
            raise ProtocolError("completions request has no 'prompt'")
        return ParsedRequest(api=api, model=body.get("model"), stream=bool(body.get("stream")), params=dict(body))
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ProtocolError("chat request has no 'messages' list of objects")
    params = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    return ParsedRequest(
        api=api,
        model=body.get("model"),
        stream=bool(body.get("stream")),
        params=params,
        tools=body.get("tools"),
        messages=[canonical_message(m) for m in messages],
        wire_messages=messages,
        session_id=(body.get("metadata") or {}).get("session_id") if isinstance(body.get("metadata"), dict) else None,
    )


def _logprob_values(logprobs: Any) -> tuple[list[float] | None, list[int] | None]:
    """Per-token logprobs, and ids when tokens come as 'token_id:N' (vLLM's return_tokens_as_token_ids)."""
    if not isinstance(logprobs, dict):
        return None, None
    if isinstance(logprobs.get("content"), list):  # chat shape
        entries = logprobs["content"]
        values = [e.get("logprob") for e in entries]
        tokens = [e.get("token") for e in entries]
    elif isinstance(logprobs.get("token_logprobs"), list):  # completions shape
        values = logprobs["token_logprobs"]
        tokens = logprobs.get("tokens") or []
    else:
        return None, None
    ids = None
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        ids = [int(t.split(":", 1)[1]) for t in tokens]
    return values, ids


def sglext_ids(sglext: Any, index: int) -> tuple[list | None, list | None]:
    """SGLang's response-level ids: the prompt's, and choice ``index``'s sampled ones."""
    if not isinstance(sglext, dict):
        return None, None
    prompt, outputs = sglext.get("input_ids"), sglext.get("output_ids")
    if isinstance(outputs, list) and outputs and all(isinstance(o, list) for o in outputs):
        outputs = outputs[index] if index < len(outputs) else None
    elif not (isinstance(outputs, list) and all(isinstance(o, int) for o in outputs)) or index:
        outputs = None
    return (prompt if isinstance(prompt, list) else None), outputs


def _choice_completion(body: dict, choice: dict, api: str) -> Completion:
    if api == COMPLETIONS:
        message = {"role": "assistant", "content": choice.get("text") or ""}
        wire = [{"text": choice.get("text") or ""}]
    else:
        wire_message = choice.get("message") or {}
        message = canonical_message({**wire_message, "role": "assistant"})
        wire = [wire_message]
    logprobs, ids_from_logprobs = _logprob_values(choice.get("logprobs"))
    sgl_prompt, sgl_output = sglext_ids(body.get("sglext"), choice.get("index", 0))
    return Completion(
        message=message,
        wire=wire,
        finish_reason=choice.get("finish_reason"),
        usage=_usage(body.get("usage")),
        response_id=body.get("id"),
        model=body.get("model"),
        prompt_ids=body.get("prompt_token_ids") or choice.get("prompt_token_ids") or sgl_prompt,
        response_ids=choice.get("token_ids") or sgl_output or ids_from_logprobs,
        logprobs=logprobs,
    )


def parse_response(body: dict, api: str = CHAT) -> Completion:
    if "error" in body and not body.get("choices"):
        return Completion(status="error", error=json.dumps(body["error"]), response_id=body.get("id"))
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise ProtocolError("response has no 'choices'")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    completion = _choice_completion(body, choices[0], api)
    completion.alternatives = [_choice_completion(body, c, api) for c in choices[1:]]
    return completion


PLAIN_DELTA = frozenset({"role", "content"})


class StreamAssembler(DoneTerminatedStream):
    """Rebuilds a Chat Completions (or Completions) response from its SSE chunks."""

    def __init__(self, api: str = CHAT):
        self.api = api
        self.response_id = None
        self.model = None
        self.usage = None
        self.done = False
        self.error = None
        self.output_started = False
        self.notes: list[str] = []
        self.prompt_ids = None
        self.choices: dict[int, dict] = {}

    def _choice(self, index: int) -> dict:
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = {
                "text": [], "reasoning": [], "calls": {}, "finish_reason": None, "ids": [], "logprobs": [],
                "has_ids": False, "has_logprobs": False, "role": "assistant",
            }
        return state

    def feed_parsed(self, event: str | None, chunk: Any) -> None:
        """One chunk, already parsed (the writer parses a stream's events in one pass)."""
        if not isinstance(chunk, dict):
            raise ProtocolError("stream chunk is not a JSON object")
        get = chunk.get
        if "error" in chunk and not get("choices"):
            self.error = json.dumps(chunk["error"])
            return
        if not self.response_id:
            self.response_id = get("id")
        if not self.model:
            self.model = get("model")
        if get("usage"):
            self.usage = _usage(chunk["usage"])
        if get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        for choice in get("choices") or ():
            self._feed_choice(choice)
        if get("sglext") is not None:  # SGLang: every choice's ids at once, in a chunk of their own
            for index in sorted(self.choices) or [0]:
                prompt, output = sglext_ids(chunk["sglext"], index)
                if prompt is not None and self.prompt_ids is None:
                    self.prompt_ids = prompt
                state = self._choice(index)
                if output is not None and not state["has_ids"]:
                    state["ids"], state["has_ids"] = list(output), True

    def _feed_choice(self, choice: dict) -> None:
        get = choice.get
        state = self._choice(get("index", 0))
        if get("prompt_token_ids") is not None:
            self.prompt_ids = choice["prompt_token_ids"]
        if self.api == COMPLETIONS:
            if get("text"):
                state["text"].append(choice["text"])
                self.output_started = True
        else:
            delta = get("delta") or {}
            if delta.get("content"):
                state["text"].append(delta["content"])
                self.output_started = True
            if not delta.keys() <= PLAIN_DELTA:  # reasoning, tool calls: not in most chunks
                reasoning = reasoning_of(delta)
                if reasoning:
                    state["reasoning"].append(reasoning)
                    self.output_started = True
                for call in delta.get("tool_calls") or []:
                    slot = state["calls"].setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": []})
                    fn = call.get("function") or {}
                    slot["id"] = call.get("id") or slot["id"]
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"].append(fn.get("arguments") or "")
                    self.output_started = True
        if get("token_ids") is not None:
            state["ids"].extend(choice["token_ids"])
            state["has_ids"] = True
        if get("logprobs") is not None:
            values, ids = _logprob_values(choice["logprobs"])
            if values is not None:
                state["logprobs"].extend(values)
                state["has_logprobs"] = True
                if ids is not None and not state["has_ids"]:
                    state.setdefault("ids_from_logprobs", []).extend(ids)
        if get("finish_reason"):
            state["finish_reason"] = choice["finish_reason"]

    def finish(self) -> Completion:
        completions = [self._completion(self.choices[i]) for i in sorted(self.choices)] or [self._completion(self._choice(0))]
        first = completions[0]
        first.notes = list(self.notes)
        first.alternatives = completions[1:]
        return first

    def _completion(self, state: dict) -> Completion:
        builder = AssistantBuilder()
        builder.text = state["text"]
        builder.reasoning = state["reasoning"]
        builder.calls = [tool_call(c["id"], c["name"], "".join(c["arguments"])) for _, c in sorted(state["calls"].items())]
        message = builder.message()
        if self.api == COMPLETIONS:
            wire = [{"text": message["content"]}]
        else:
            wire_message = {"role": "assistant", "content": message["content"] or None}
            if builder.calls:
                wire_message["tool_calls"] = builder.calls
            if builder.reasoning:
                wire_message["reasoning_content"] = message["reasoning_content"]
            wire = [wire_message]
        status, error = "ok", self.error
        if error:
            status = "error"
        elif not (self.done or state["finish_reason"]):
            status, error = "incomplete", "stream ended before the final chunk"
        return Completion(
            message=message,
            wire=wire,
            finish_reason=state["finish_reason"],
            usage=self.usage,
            response_id=self.response_id,
            model=self.model,
            status=status,
            error=error,
            prompt_ids=self.prompt_ids,
            response_ids=state["ids"] if state["has_ids"] else state.get("ids_from_logprobs"),
            logprobs=state["logprobs"] if state["has_logprobs"] else None,
        )


CHAT_PROTOCOL = Protocol(api=CHAT, path=r"/chat/completions$", parse_request=parse_request,
                         parse_response=parse_response, StreamAssembler=StreamAssembler, engine_ids="chat")
COMPLETIONS_PROTOCOL = Protocol(api=COMPLETIONS, path=r"/v1/completions$", parse_request=parse_request,
                                parse_response=parse_response, StreamAssembler=StreamAssembler,
                                engine_ids="completions", prompt_is_text=True)
PROTOCOLS = (CHAT_PROTOCOL, COMPLETIONS_PROTOCOL)
