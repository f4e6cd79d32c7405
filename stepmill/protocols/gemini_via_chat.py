"""Gemini's generateContent served through an engine's chat completions, for exact token ids.

vLLM and SGLang have no Gemini endpoint (a Gemini CLI pointed at one gets a 404). For an engine host the
proxy sends the agent's ``generateContent`` call to the engine's ``/v1/chat/completions``, asking for ids,
and translates the answer back — whole, or streamed chunk by chunk as ``?alt=sse`` events — so the agent
sees a faithful Gemini exchange while the step holds what the engine sampled. A ``streamGenerateContent``
call without ``?alt=sse`` (a JSON array) is served whole and answered as an array of one response.

Function calls have no ids in Gemini's older form: the k-th call of model turn i is ``call-i-k`` on the
chat side, and the function responses of the next user turn answer its calls in order.

On the event loop: the request is translated once before it moves; a stream per event as it arrives
(``StreamTranslator``, plugged into the stream tap). Pure functions otherwise.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stepmill.protocols.contract import Translated
from stepmill.protocols.gemini_wire import PATH, _get, _parts, model_from_path, streamed_path, tools_of
from stepmill.protocols.openai_chat import reasoning_of
from stepmill.protocols.via_chat import ChatStreamTranslator, error_message, not_carried, tool_arguments

ENGINE_ENDPOINT = False  # engines have no Gemini endpoint
NOTE = ("a Gemini generateContent call, served through the engine's chat completions for exact token ids; the agent "
        "got the answer as Gemini's")
FINISH = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP", "length": "MAX_TOKENS", "abort": "OTHER"}


class Untranslatable(ValueError):
    """A request the chat protocol cannot carry: the proxy answers it with a 400 in Gemini's shape (the engine
    has no Gemini route to send it to)."""


def chat_path(path: str) -> str:
    """Where the engine's chat completions are, beside the Gemini path: ``/x/v1beta/models/m:…`` → ``/x/v1/…``."""
    bare = path.split("?", 1)[0]
    found = PATH.search(bare)
    prefix = bare[: found.start()] if found else bare
    while re.search(r"/v1[a-z0-9]*$", prefix):  # a base URL that ends in /v1 too: /v1/v1beta/models/…
        prefix = prefix.rsplit("/", 1)[0]
    return prefix + "/v1/chat/completions"


def _lower_types(schema: Any) -> Any:
    """Gemini's OpenAPI-style schemas say ``"type": "OBJECT"``; JSON Schema says ``"object"``."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def messages_of(body: dict) -> list[dict]:
    out: list[dict] = []
    system = _get(body, "systemInstruction")
    if system is not None:
        text = system if isinstance(system, str) else "".join(
            p.get("text", "") for p in _parts(system, "systemInstruction"))
        out.append({"role": "system", "content": text})
    pending: list[tuple[str, str]] = []  # (id, name) of the last model turn's calls, answered in order
    for i, content in enumerate(body.get("contents") or []):
        if not isinstance(content, dict):
            raise Untranslatable(f"contents[{i}] is not an object")
        parts = _parts(content, f"contents[{i}]")
        if content.get("role") == "model":
            text, calls = [], []
            for part in parts:
                call = _get(part, "functionCall")
                if isinstance(call, dict):
                    call_id = call.get("id") or f"call-{i}-{len(calls)}"
                    calls.append({"id": call_id, "type": "function", "function": {
                        "name": call.get("name"), "arguments": json.dumps(call.get("args") or {}, ensure_ascii=False)}})
                elif isinstance(part.get("text"), str) and not part.get("thought"):
                    text.append(part["text"])
            message: dict = {"role": "assistant", "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            pending = [(c["id"], c["function"]["name"]) for c in calls]
            continue
        text = []
        for part in parts:
            answer = _get(part, "functionResponse")
            if isinstance(answer, dict):
                ids = [call_id for call_id, _ in pending]
                if answer.get("id") in ids:  # answered by id: that call is answered
                    index = ids.index(answer["id"])
                else:  # by name, in order
                    index = next((k for k, (_, name) in enumerate(pending) if name == answer.get("name")), None)
                # a response to no call of the last model turn (its history cut short): its own id, or one made
                call_id = pending.pop(index)[0] if index is not None else answer.get("id") or f"call-{i}-{answer.get('name')}"
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": json.dumps(answer.get("response"), ensure_ascii=False, sort_keys=True)})
            elif isinstance(part.get("text"), str):
                text.append(part["text"])
            else:
                raise Untranslatable(f"a user part of kind {sorted(part)} has no chat form here")
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out


# generationConfig fields with a chat parameter of the same meaning
SAMPLING = (("temperature", "temperature"), ("topP", "top_p"), ("topK", "top_k"), ("maxOutputTokens", "max_tokens"),
            ("stopSequences", "stop"), ("seed", "seed"), ("candidateCount", "n"), ("presencePenalty", "presence_penalty"),
            ("frequencyPenalty", "frequency_penalty"))
# read below (responseMimeType with its schema, thinkingConfig, responseModalities)
CONFIG_READ = {gemini for gemini, _ in SAMPLING} | {"responseMimeType", "responseSchema", "responseJsonSchema",
                                                    "thinkingConfig", "responseModalities"}
# top-level fields: the conversation, the tools (read where they are), and the agent's own bookkeeping
BODY_READ = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "model", "labels"}
TOOL_CHOICE = {"AUTO": "auto", "ANY": "required", "NONE": "none", "MODE_UNSPECIFIED": "auto"}


def _camel(key: str) -> str:
    """A field name in Gemini's JSON spelling: ``response_mime_type`` → ``responseMimeType``."""
    head, *rest = key.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def _response_format(config: dict, notes: list[str]) -> dict | None:
    """Gemini's JSON mode as chat's ``response_format`` (vLLM and SGLang constrain decoding to it)."""
    mime = _get(config, "responseMimeType")
    schema, json_schema = _get(config, "responseSchema"), _get(config, "responseJsonSchema")
    if mime in (None, "text/plain"):
        if schema is not None or json_schema is not None:
            not_carried(notes, "generationConfig ", ["a response schema without JSON mode"])
        return None
    if mime != "application/json":
        not_carried(notes, "generationConfig.responseMimeType ", [repr(mime)])
        return None
    if json_schema is not None:
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": json_schema}}
    if schema is not None:
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": _lower_types(schema)}}
    return {"type": "json_object"}


def _tool_choice(body: dict, notes: list[str]) -> Any:
    """``toolConfig.functionCallingConfig`` as chat's ``tool_choice`` (None: the engine's default, auto)."""
    tool_config = _get(body, "toolConfig")
    if tool_config is None:
        return None
    calling = _get(tool_config, "functionCallingConfig") if isinstance(tool_config, dict) else None
    rest = sorted(_camel(k) for k in tool_config if _camel(k) != "functionCallingConfig") \
        if isinstance(tool_config, dict) else [repr(tool_config)]
    not_carried(notes, "toolConfig ", rest)
    if not isinstance(calling, dict):
        return None
    mode = str(_get(calling, "mode") or "AUTO").upper()
    names = _get(calling, "allowedFunctionNames") or []
    if mode == "ANY" and isinstance(names, list) and len(names) == 1:
        return {"type": "function", "function": {"name": names[0]}}
    if names:
        not_carried(notes, f"toolConfig's allowedFunctionNames (mode {mode}) ", [repr(names)],
                     ": any declared function may be called")
    if mode not in TOOL_CHOICE:
        not_carried(notes, "toolConfig's function calling mode ", [mode], " (sent as auto)")
    return TOOL_CHOICE.get(mode, "auto")


def request_to_chat(body: dict, path: str, engine: str = "vllm", notes: list[str] | None = None) -> dict:
    """The Gemini request as the chat request that asks the engine for the same sample, with ids. What the
    chat request cannot carry is said in ``notes`` (a list this appends to), field by field."""
    notes = [] if notes is None else notes
    chat: dict = {"model": model_from_path(path) or body.get("model"), "messages": messages_of(body),
                  "logprobs": True}
    if engine == "sglang":
        chat["return_input_ids_in_sglext"] = chat["return_output_ids_in_sglext"] = True
    else:
        chat["return_token_ids"] = True
    config = _get(body, "generationConfig") or {}
    for gemini, name in SAMPLING:
        value = _get(config, gemini)
        if value is not None:
            chat[name] = value
    response_format = _response_format(config, notes)
    if response_format is not None:
        chat["response_format"] = response_format
    thinking = _get(config, "thinkingConfig")
    # The engine's reasoning comes back as thought parts: includeThoughts true is what it does; a budget of -1 (the
    # model decides) is what an engine's model does.
    unheld = {_camel(k): v for k, v in thinking.items()} if isinstance(thinking, dict) else {}
    if unheld.get("includeThoughts") is True:
        del unheld["includeThoughts"]
    if unheld.get("thinkingBudget") == -1:
        del unheld["thinkingBudget"]
    not_carried(notes, "generationConfig.thinkingConfig ", [json.dumps(unheld, sort_keys=True)] if unheld else [])
    modalities = _get(config, "responseModalities")
    if modalities and [str(m).upper() for m in modalities] != ["TEXT"]:
        not_carried(notes, "generationConfig.responseModalities ", [repr(modalities)], ": the engine answers text")
    not_carried(notes, "generationConfig ", sorted(k for k in map(_camel, config) if k not in CONFIG_READ))
    tools = tools_of(body)
    if tools:
        chat["tools"] = [{**t, "function": {**t["function"], "parameters": _lower_types(t["function"]["parameters"])}}
                         for t in tools]
    other_tools = {_camel(k) for t in body.get("tools") or [] if isinstance(t, dict) for k in t}
    not_carried(notes, "tools ", sorted(other_tools - {"functionDeclarations"}), " (function declarations are)")
    tool_choice = _tool_choice(body, notes)
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    not_carried(notes, "", sorted(k for k in map(_camel, body) if k not in BODY_READ))
    if "?alt=sse" in path or "&alt=sse" in path:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def translate(body: dict, path: str, engine: str = "vllm") -> Translated:
    """The call for the engine's chat completions, what the answer's translation back needs (an array of one
    for a JSON-array stream), and what the chat request could not carry."""
    notes: list[str] = []
    chat = request_to_chat(body, path, engine, notes)
    options = {"model": chat["model"]}
    if streamed_path(path) and not chat.get("stream"):
        options["array"] = True
    return Translated(chat, chat_path(path), options, notes)


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, output = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return {"promptTokenCount": prompt, "candidatesTokenCount": output, "totalTokenCount": prompt + output}


def _call(call_id: Any, name: Any, arguments: Any) -> dict:
    """A chat tool call as a Gemini functionCall, with the engine's id: Gemini CLI keeps an id it is given and
    sends it back with the call and its response, so the next turn's history repeats this turn exactly."""
    call = {"name": name, "args": tool_arguments(arguments)}
    return {"id": call_id, **call} if call_id else call


def _response(parts: list, *, finish: str | None, usage: dict | None, model: str | None, chat_id: Any) -> dict:
    candidate: dict = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    out = {"candidates": [candidate], "modelVersion": model, "responseId": str(chat_id or "")}
    if usage is not None:
        out["usageMetadata"] = _usage(usage)
    return out


def answer_of(payload: dict, *, model: str | None, array: bool = False) -> Any:
    """The engine's whole chat answer as the Gemini answer the agent expects (ids and logprobs dropped);
    an array of it for a ``streamGenerateContent`` call without ``alt=sse``."""
    if "choices" not in payload:
        return error_body(payload)
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    parts: list[dict] = []
    reasoning = reasoning_of(message)
    if reasoning:
        parts.append({"text": reasoning, "thought": True})
    if message.get("content"):
        parts.append({"text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        if choice.get("finish_reason") == "length" and "_unparsed_arguments" in tool_arguments(function.get("arguments")):
            continue  # a call cut by the token limit is no call to run
        parts.append({"functionCall": _call(call.get("id"), function.get("name"), function.get("arguments"))})
    answer = _response(parts, finish=FINISH.get(choice.get("finish_reason"), "OTHER"), usage=payload.get("usage"),
                       model=model or payload.get("model"), chat_id=payload.get("id"))
    return [answer] if array else answer


# Google's status names for the HTTP statuses an engine answers with (google.rpc.Code)
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          409: "ABORTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
          503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def error_body(payload: Any, status: int | None = None) -> dict:
    """An engine's error in Gemini's shape, its code the HTTP status it came with (an error chunk of a
    stream has none: 400)."""
    code = status or 400
    return {"error": {"code": code, "message": error_message(payload)[0],
                      "status": STATUS.get(code, "INTERNAL" if code >= 500 else "INVALID_ARGUMENT")}}


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass") \
        + b"\r\n\r\n"


class StreamTranslator(ChatStreamTranslator):
    """Chat completion chunks in, Gemini ``alt=sse`` chunks out: text and thoughts as they come; function
    calls whole (Gemini never streams a call's arguments), with the finishReason and usage at the end."""

    def __init__(self, *, model: str | None):
        self.model = model
        self.calls: dict[int, dict] = {}
        self.finish: str | None = None
        self.usage: dict | None = None
        self.chat_id = None

    def on_error(self, chunk: dict) -> bytes:
        return sse(error_body(chunk))

    def on_chunk(self, chunk: dict) -> bytes:
        self.chat_id = self.chat_id or chunk.get("id")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        parts = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                parts.append({"text": reasoning, "thought": True})
            if delta.get("content"):
                parts.append({"text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                held = self.calls.setdefault(call.get("index", 0), {"id": None, "name": None, "arguments": []})
                held["id"] = call.get("id") or held["id"]
                held["name"] = function.get("name") or held["name"]
                held["arguments"].append(function.get("arguments") or "")
            if choice.get("finish_reason"):
                self.finish = FINISH.get(choice["finish_reason"], "OTHER")
        return sse(_response(parts, finish=None, usage=None, model=self.model, chat_id=self.chat_id)) if parts else b""

    def close(self) -> bytes:
        """The end of the stream: the calls, the finishReason and the usage in one last chunk."""
        if self.done:
            return b""
        self.done = True
        if not self.finished and self.finish is None:  # cut short: the agent must not take it as a whole answer
            return sse({"error": {"code": 502, "message": "the engine's stream ended before its last chunk",
                                  "status": "UNAVAILABLE"}})
        calls = [call for _, call in sorted(self.calls.items())]
        if self.finish == "MAX_TOKENS":  # a call cut by the token limit is no call to run
            calls = [c for c in calls if "_unparsed_arguments" not in tool_arguments("".join(c["arguments"]))]
        parts = [{"functionCall": _call(call["id"], call["name"], "".join(call["arguments"]))} for call in calls]
        return sse(_response(parts, finish=self.finish or "STOP", usage=self.usage, model=self.model,
                             chat_id=self.chat_id))
