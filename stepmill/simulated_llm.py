"""A SIMULATED LLM — no model at all — for the demo and the tests, clearly labelled as such.

It speaks the OpenAI protocol the way a vLLM server does (``/v1/models`` owned by ``vllm``,
``/v1/chat/completions`` and ``/v1/completions``, streamed or not, tool calls, ``n``, logprobs,
and vLLM's token-id fields ``return_token_ids`` → ``prompt_token_ids`` / ``token_ids``), and
tokenizes with the real Qwen2 vocabulary and chat template, so the ids it returns are what a
Qwen model served by vLLM would return for the same text. For agent CLIs it also answers the
Responses API (``/v1/responses``, Codex) and Anthropic Messages (``/v1/messages``, Claude Code),
streamed or not.

What it "says" is decided by a seeded coin, not by a network: for an arithmetic task it calls
the calculator tool (or a shell tool, with ``python3 -c 'print(…)'``) or answers directly, and is
right only some of the time — so rollouts of one task differ and rewards have something to tell
apart. Agents that must end with a command (mini-swe-agent) get it.

    stepmill simulate-llm --port 8000          # then: OPENAI_BASE_URL=http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stepmill.http_answers import send_json
from stepmill.protocols.messages import content_text

MODEL = "stepmill-simulated-qwen"
MAX_MODEL_LEN = 32768  # the context it says it has, as vLLM does (/v1/models, /tokenize)
LABEL = "stepmill simulated LLM (not a model: seeded coin flips over arithmetic, real Qwen2 token ids)"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_EXPRESSION = re.compile(r"[-+*/().\d\s]*\d[-+*/().\d\s]*[-+*/][-+*/().\d\s]*\d[-+*/().\d\s]*")
_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)


@dataclass
class Reply:
    content: str  # the text of the reply
    tool_call: dict | None = None  # {"name", "arguments"} when the reply calls a tool

    @property
    def text(self) -> str:
        """What the model generates, in Qwen's format (a tool call as a <tool_call> block)."""
        if self.tool_call is None:
            return self.content
        block = f"<tool_call>\n{json.dumps(self.tool_call)}\n</tool_call>"
        return f"{self.content}\n{block}" if self.content else block


SHELL_TOOLS = ("bash", "Bash", "shell", "exec_command", "local_shell", "run_shell_command")
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent ends when a command prints it
_FENCED = re.compile(r"```.*?```", re.S)
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?!.*\d)", re.S)


def find_expression(text: str) -> str | None:
    """The longest arithmetic expression in a task ('What is 17 * 23 + 4?' → '17 * 23 + 4')."""
    found = [m.group().strip().rstrip(".") for m in _EXPRESSION.finditer(text)]
    return max(found, key=len) if found else None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def shell_call(name: str, schema: dict, command: str) -> dict:
    """A call of a shell tool in the shape its schema asks for: ``command`` or ``cmd``, a string or an argv list."""
    properties = (schema or {}).get("properties") or {}
    key = next((k for k in ("command", "cmd") if k in properties), "command")
    kind = (properties.get(key) or {}).get("type")
    return {"name": name, "arguments": {key: ["bash", "-lc", command] if kind == "array" else command}}


_TAGGED = re.compile(r"<([\w-]+)[^>]*>.*?</\1>", re.S)  # <environment_context>…, <system-reminder>…
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def task_text(turns: list[str]) -> str:
    """The latest request of the user: not a tool result, without fenced code, tagged context or dates."""
    asks = [t.split("\n", 1)[-1] for t in turns if t.startswith("user") and "<tool_response>" not in t]
    for text in reversed(asks):
        text = _DATE.sub("", _TAGGED.sub("", _FENCED.sub("", text)))
        if find_expression(text):
            return text
    return asks[-1] if asks else ""


class SimulatedPolicy:
    """Decides a reply from the rendered prompt: the same prompt gets a fresh coin each time it is
    asked (the k-th time with the k-th coin of its seed), so n rollouts of one task differ while a
    rerun of the whole demo gives the same multiset of answers."""

    def __init__(self, seed: int = 0, tool_rate: float = 0.7, direct_accuracy: float = 0.4,
                 tool_accuracy: float = 0.8):
        self.seed, self.tool_rate = seed, tool_rate
        self.direct_accuracy, self.tool_accuracy = direct_accuracy, tool_accuracy
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def _coins(self, prompt: str) -> random.Random:
        digest = hashlib.sha256(prompt.encode()).hexdigest()
        with self._lock:
            count = self._seen.get(digest, 0)
            self._seen[digest] = count + 1
        return random.Random(f"{self.seed}:{digest}:{count}")

    def reply(self, prompt: str, tools: dict[str, dict] | None = None) -> Reply:
        """``prompt``: the rendered ChatML text; ``tools``: the offered tools' names and parameter schemas."""
        from stepmill.agents.tool_loop import calculate

        tools = tools or {}
        coins = self._coins(prompt)
        turns = prompt.split(IM_START)
        shell = next((name for name in SHELL_TOOLS if name in tools), None)
        submit = shell is not None and SUBMIT in prompt
        finish = shell_call(shell, tools.get(shell), f"echo {SUBMIT}") if submit else None
        last = next((t for t in reversed(turns) if t.startswith(("user", "tool"))), "")
        results = _TOOL_RESPONSE.findall(last)
        if results:  # a tool answered: report its number, usually faithfully
            if SUBMIT in results[-1]:
                return Reply("Submitted.")
            found = _LAST_NUMBER.search(results[-1])
            if not found:
                return Reply("The tool gave no number. \\boxed{0}", finish)
            value = found.group()
            if coins.random() >= self.tool_accuracy:
                value = _slip(value, coins)
            return Reply(f"The tool says {found.group()}, so the answer is \\boxed{{{value}}}.", finish)
        expression = find_expression(task_text(turns))
        if expression is None:
            return Reply("I can only do arithmetic. \\boxed{0}", finish)
        expression = " ".join(expression.split())
        if "calculator" in tools and coins.random() < self.tool_rate:
            return Reply("", {"name": "calculator", "arguments": {"expression": expression}})
        if shell and coins.random() < self.tool_rate:
            return Reply(f"Let me compute {expression}.", shell_call(shell, tools[shell], f"python3 -c 'print({expression})'"))
        try:
            value = calculate(expression)
        except (ValueError, ZeroDivisionError, SyntaxError, TypeError):
            return Reply("That expression does not compute. \\boxed{0}", finish)
        value = _number(float(value))
        if coins.random() >= self.direct_accuracy:
            value = _slip(value, coins)
        return Reply(f"Working it out in my head: {expression} = {value}. \\boxed{{{value}}}", finish)


def _slip(value: str, coins: random.Random) -> str:
    """A plausible wrong answer: off by a little."""
    try:
        number = float(value)
    except ValueError:
        return value + "0"
    return _number(number + coins.choice([-10, -2, -1, 1, 2, 10]))


def function_tools(tools: list | None) -> list[dict]:
    """Tools of any protocol in the OpenAI function shape the chat template takes."""
    out = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("function"), dict):  # chat: {"type": "function", "function": {...}}
            out.append(tool)
        elif tool.get("name"):  # Responses (flat) and Anthropic (input_schema)
            out.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description", ""),
                "parameters": tool.get("parameters") or tool.get("input_schema") or {"type": "object"}}})
    return out


class SimulatedModel:
    """Tokenizer + policy: the request in, the reply's text and exact ids out."""

    def __init__(self, tokenizer_folder: str, policy: SimulatedPolicy, delay: float = 0.0):
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
        self.end_id = self.tokenizer.convert_tokens_to_ids(IM_END)
        self.policy = policy
        self.delay = delay
        self.weight_version = "default"  # vLLM's label until /update_weight_version names one

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool = True) -> str:
        flat = []
        for m in messages:
            message = {**m, "content": content_text(m.get("content"))}
            if m.get("tool_calls"):
                message["tool_calls"] = [c for c in m["tool_calls"] if isinstance(c, dict) and c.get("function")]
            flat.append(message)
        return self.tokenizer.apply_chat_template(flat, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompt: str, tools: list[dict]) -> tuple[Reply, list[int], list[float]]:
        offered = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        reply = self.policy.reply(prompt, offered)
        ids = self.encode(reply.text) + [self.end_id]  # the stop token is sampled too
        rng = random.Random(len(ids))
        logprobs = [round(-abs(rng.gauss(0, 0.4)), 4) for _ in ids]
        if self.delay:
            time.sleep(self.delay)
        return reply, ids, logprobs


class BadRequest(ValueError):
    pass


def _call_id(prefix: str = "call") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def chat_completion(llm: SimulatedModel, body: dict) -> tuple[dict, list[dict]]:
    """The non-streamed answer and the chunks of the streamed one, for one chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of message objects")
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise BadRequest("n must be an integer from 1 to 16")
    tools = function_tools(body.get("tools"))
    prompt = llm.render(messages, tools)
    prompt_ids = llm.encode(prompt)
    want_ids, want_logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
    rid, model = f"chatcmpl-sim-{uuid.uuid4().hex[:12]}", body.get("model") or MODEL
    base = {"id": rid, "created": int(time.time()), "model": model, "system_fingerprint": "stepmill-simulated"}
    choices, chunks, completion_tokens = [], [], 0
    for index in range(n):
        reply, ids, logprobs = llm.generate(prompt, tools)
        completion_tokens += len(ids)
        message, finish = {"role": "assistant", "content": reply.content or None}, "stop"
        if reply.tool_call:
            message["tool_calls"] = [{"id": _call_id(), "type": "function", "function": {
                "name": reply.tool_call["name"], "arguments": json.dumps(reply.tool_call["arguments"])}}]
            finish = "tool_calls"
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": _chat_logprobs(llm, ids, logprobs) if want_logprobs else None}
        if want_ids:
            choice["token_ids"] = ids
        choices.append(choice)
        chunks.extend(_chat_chunks(llm, base, index, message, finish, ids, logprobs, want_ids, want_logprobs))
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
             "total_tokens": len(prompt_ids) + completion_tokens}
    payload = {**base, "object": "chat.completion", "choices": choices, "usage": usage}
    if want_ids:
        payload["prompt_token_ids"] = prompt_ids
        chunks[0]["prompt_token_ids"] = prompt_ids
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    return payload, chunks


def _chat_logprobs(llm: SimulatedModel, ids: list[int], logprobs: list[float]) -> dict:
    tokens = llm.tokenizer.convert_ids_to_tokens(ids)
    return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


def _chat_chunks(llm, base, index, message, finish, ids, logprobs, want_ids, want_logprobs) -> list[dict]:
    chunk = {**base, "object": "chat.completion.chunk"}
    out = [{**chunk, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}]}]
    if message.get("tool_calls"):  # the text, then the call whole, its ids on the last event
        pieces = [([], {"content": message["content"]})] if message.get("content") else []
        pieces.append((ids, {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}))
    else:  # four tokens an event, each with the text its tokens add
        pieces, said = [], ""
        for start in range(0, len(ids), 4):
            text = llm.tokenizer.decode(ids[:start + 4], skip_special_tokens=True)
            pieces.append((ids[start:start + 4], {"content": text[len(said):]}))
            said = text
    position = 0
    for group, delta in pieces:
        choice = {"index": index, "delta": delta, "finish_reason": None}
        if want_ids:
            choice["token_ids"] = group
        if want_logprobs:
            choice["logprobs"] = _chat_logprobs(llm, group, logprobs[position:position + len(group)])
        position += len(group)
        out.append({**chunk, "choices": [choice]})
    out.append({**chunk, "choices": [{"index": index, "delta": {}, "finish_reason": finish}]})
    return out


def completion(llm: SimulatedModel, body: dict) -> dict:
    """A /v1/completions answer; the prompt is text or token ids (token-in, token-out)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in prompt):
        if max(prompt) >= len(llm.tokenizer):
            raise BadRequest(f"token id {max(prompt)} is outside the vocabulary ({len(llm.tokenizer)})")
        prompt_ids = prompt
        text = llm.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    elif isinstance(prompt, str):
        text, prompt_ids = prompt, llm.encode(prompt)
    else:
        raise BadRequest("prompt must be a string or a list of token ids")
    reply, ids, logprobs = llm.generate(text, tools_in_prompt(text))
    choice = {"index": 0, "text": reply.text, "finish_reason": "stop",
              "logprobs": None if body.get("logprobs") is None else {
                  "tokens": llm.tokenizer.convert_ids_to_tokens(ids), "token_logprobs": logprobs,
                  "top_logprobs": None, "text_offset": None}}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = ids
    return {"id": f"cmpl-sim-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or MODEL, "system_fingerprint": "stepmill-simulated", "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)}}


def generate_tokens(llm: SimulatedModel, body: dict) -> dict:
    """vLLM's token-in, token-out route (/inference/v1/generate, served with --enable-scale-out), in its
    shapes: sampling in ``sampling_params``, the ids, the text (output_mode "text") or not, and the weight
    version that sampled each token (the label /update_weight_version set; "default" before any)."""
    ids = body.get("token_ids")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise BadRequest("sampling_params must be an object")
    answer = completion(llm, {"prompt": ids, "return_token_ids": True, "logprobs": sampling.get("logprobs")})
    choice = answer["choices"][0]
    out_ids = choice["token_ids"]
    text_mode = body.get("output_mode") == "text"
    logprobs = None
    if sampling.get("logprobs") is not None:
        tokens = llm.tokenizer.convert_ids_to_tokens(out_ids)
        values = choice["logprobs"]["token_logprobs"]
        logprobs = {"content": [({"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}
                                 if text_mode else {"token_id": token_id, "logprob": value, "rank": 1,
                                                    "top_logprobs": []})
                                for token, token_id, value in zip(tokens, out_ids, values)]}
    result = {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": out_ids, "routed_experts": None,
              "sampling_mask": None, "weight_versions": [{"version": llm.weight_version, "start": 0, "end": len(out_ids)}],
              "logprobs": logprobs, **({"text": choice["text"]} if text_mode else {})}
    return {"request_id": f"generate-tokens-{uuid.uuid4().hex[:16]}", "model": body.get("model") or MODEL,
            "created": int(time.time()), "usage": answer["usage"], "prompt_token_ids": None,
            "output_mode": "text" if text_mode else "tokens", "choices": [result]}


_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.S)


def tools_in_prompt(text: str) -> list[dict]:
    """The tools a raw Qwen-format prompt lists (one JSON object a line inside <tools>)."""
    blocks = _TOOLS_BLOCK.findall(text)  # the last: the template also names the tags in its prose
    tools = []
    for line in (blocks[-1].splitlines() if blocks else []):
        try:
            tools.append(json.loads(line))
        except ValueError:
            continue
    return function_tools(tools)


def _canonical(parse, body: dict):
    from stepmill.protocols.base import ProtocolError

    try:
        return parse(body)
    except ProtocolError as exc:
        raise BadRequest(str(exc)) from None


def anthropic_message(llm: SimulatedModel, body: dict) -> tuple[dict, list[tuple[str, dict]]]:
    """An Anthropic Messages answer and its stream events (``(event name, data)``)."""
    from stepmill.protocols import anthropic_messages

    request = _canonical(anthropic_messages.parse_request, body)
    tools = function_tools(body.get("tools"))
    prompt = llm.render(request.messages, tools)
    reply, ids, _ = llm.generate(prompt, tools)
    content = [{"type": "text", "text": reply.content}] if reply.content else []
    if reply.tool_call:
        content.append({"type": "tool_use", "id": _call_id("toolu"), "name": reply.tool_call["name"],
                        "input": reply.tool_call["arguments"]})
    usage = {"input_tokens": len(llm.encode(prompt)), "output_tokens": len(ids)}
    message = {"id": f"msg_sim_{uuid.uuid4().hex[:12]}", "type": "message", "role": "assistant",
               "model": body.get("model") or MODEL, "content": content,
               "stop_reason": "tool_use" if reply.tool_call else "end_turn", "stop_sequence": None, "usage": usage}
    events = [("message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}})]
    for index, block in enumerate(content):
        if block["type"] == "text":
            events += [("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {"type": "text", "text": ""}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "text_delta", "text": block["text"]}})]
        else:
            events += [("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {**block, "input": {}}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                           "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                                      "stop_sequence": None},
                                  "usage": {"output_tokens": len(ids)}}),
               ("message_stop", {"type": "message_stop"})]
    return message, events


def response(llm: SimulatedModel, body: dict) -> tuple[dict, list[tuple[str, dict]]]:
    """A Responses API answer and its stream events."""
    from stepmill.protocols import openai_responses

    request = _canonical(openai_responses.parse_request, body)
    tools = function_tools(body.get("tools"))
    prompt = llm.render(request.messages, tools)
    reply, ids, _ = llm.generate(prompt, tools)
    rid = f"resp_sim_{uuid.uuid4().hex[:12]}"
    output = []
    if reply.content:
        output.append({"type": "message", "id": f"msg_sim_{uuid.uuid4().hex[:12]}", "status": "completed",
                       "role": "assistant", "content": [{"type": "output_text", "text": reply.content,
                                                         "annotations": []}]})
    if reply.tool_call:
        output.append({"type": "function_call", "id": f"fc_sim_{uuid.uuid4().hex[:12]}", "status": "completed",
                       "call_id": _call_id(), "name": reply.tool_call["name"],
                       "arguments": json.dumps(reply.tool_call["arguments"])})
    prompt_tokens = len(llm.encode(prompt))
    done = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": body.get("model") or MODEL, "output": output, "usage": {
                "input_tokens": prompt_tokens, "output_tokens": len(ids), "total_tokens": prompt_tokens + len(ids),
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}
    if body.get("enable_response_messages"):  # as vLLM: the prompt's and the sample's exact tokens
        done["input_messages"] = [{"type": "raw_message_tokens", "message": prompt, "tokens": llm.encode(prompt)}]
        done["output_messages"] = [{"type": "raw_message_tokens", "message": reply.text, "tokens": ids}]
    started = {**done, "status": "in_progress", "output": [], "usage": None, "input_messages": None,
               "output_messages": None}
    events = [("response.created", {"type": "response.created", "response": started}),
              ("response.in_progress", {"type": "response.in_progress", "response": started})]
    for index, item in enumerate(output):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [
                ("response.output_item.added", {"type": "response.output_item.added", "output_index": index,
                                                "item": {**item, "status": "in_progress", "content": []}}),
                ("response.content_part.added", {"type": "response.content_part.added", "item_id": item["id"],
                                                 "output_index": index, "content_index": 0,
                                                 "part": {"type": "output_text", "text": "", "annotations": []}}),
                ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": item["id"],
                                                "output_index": index, "content_index": 0, "delta": text}),
                ("response.output_text.done", {"type": "response.output_text.done", "item_id": item["id"],
                                               "output_index": index, "content_index": 0, "text": text}),
                ("response.content_part.done", {"type": "response.content_part.done", "item_id": item["id"],
                                                "output_index": index, "content_index": 0,
                                                "part": item["content"][0]})]
        else:
            events += [
                ("response.output_item.added", {"type": "response.output_item.added", "output_index": index,
                                                "item": {**item, "status": "in_progress", "arguments": ""}}),
                ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                            "item_id": item["id"], "output_index": index,
                                                            "delta": item["arguments"]}),
                ("response.function_call_arguments.done", {"type": "response.function_call_arguments.done",
                                                           "item_id": item["id"], "output_index": index,
                                                           "arguments": item["arguments"]})]
        events.append(("response.output_item.done", {"type": "response.output_item.done", "output_index": index,
                                                      "item": item}))
    events.append(("response.completed", {"type": "response.completed", "response": done}))
    for number, (_, data) in enumerate(events):
        data["sequence_number"] = number
    return done, events


def tokenize(llm: SimulatedModel, body: dict) -> dict:
    """vLLM's ``POST /tokenize``: ``prompt`` encoded, or ``messages`` rendered with the chat template."""
    if "messages" in body:
        text = llm.render(body["messages"], function_tools(body.get("tools")),
                             generation_prompt=bool(body.get("add_generation_prompt", True)))
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise BadRequest("tokenize needs 'prompt' or 'messages'")
    ids = llm.encode(text)
    out = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    if body.get("return_token_strs"):
        out["token_strs"] = llm.tokenizer.convert_ids_to_tokens(ids)
    return out


def make_server(llm: SimulatedModel, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "stepmill-simulated-llm"

        def log_message(self, *args):  # quiet: the proxy records every call anyway
            pass

        _json = send_json  # status + JSON body

        def _error(self, status: int, message: str):
            self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                return self._json(200, {"object": "list", "data": [
                    {"id": MODEL, "object": "model", "owned_by": "vllm", "created": 0, "root": MODEL,
                     "max_model_len": MAX_MODEL_LEN, "description": LABEL}]})
            if self.path.rstrip("/") in ("/health", "/v1/health", ""):
                return self._json(200, {"ok": True, "simulated": True, "label": LABEL})
            self._error(404, f"no route {self.path}")

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                path = self.path.split("?", 1)[0].rstrip("/")
                if path.endswith("/chat/completions"):
                    payload, chunks = chat_completion(llm, body)
                    return self._sse([(None, c) for c in chunks] + [(None, "[DONE]")]) if body.get("stream") \
                        else self._json(200, payload)
                if path.endswith("/completions"):
                    return self._json(200, completion(llm, body))
                if path == "/inference/v1/generate":
                    return self._json(200, generate_tokens(llm, body))
                if path == "/update_weight_version":  # vLLM's admin route (dev mode)
                    llm.weight_version = str(body.get("new_version"))
                    return self._json(200, {"success": True, "new_version": llm.weight_version})
                if path == "/tokenize":  # vLLM's: a prompt, or chat messages through the template
                    return self._json(200, tokenize(llm, body))
                if path.endswith("/messages/count_tokens"):
                    from stepmill.protocols import anthropic_messages

                    request = _canonical(anthropic_messages.parse_request, {"messages": [], **body})
                    prompt = llm.render(request.messages, function_tools(body.get("tools")))
                    return self._json(200, {"input_tokens": len(llm.encode(prompt))})
                if path.endswith("/messages"):
                    payload, events = anthropic_message(llm, body)
                    return self._sse(events) if body.get("stream") else self._json(200, payload)
                if path.endswith("/responses"):
                    payload, events = response(llm, body)
                    return self._sse(events) if body.get("stream") else self._json(200, payload)
                return self._error(404, f"no route {self.path}")
            except (ValueError, BadRequest) as exc:
                return self._error(400, str(exc))

        def _sse(self, events: list[tuple[str | None, dict | str]]):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the body ends when the connection does
            self.end_headers()
            for name, data in events:
                head = f"event: {name}\n".encode() if name else b""
                payload = data if isinstance(data, str) else json.dumps(data)
                self.wfile.write(head + b"data: " + payload.encode() + b"\n\n")
                self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokenizer", help="A tokenizer folder (default: the bundled Qwen2 vocabulary).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0, help="Seconds each generation takes.")
    args = parser.parse_args(argv)
    from stepmill.qwen_vocab import default_folder

    llm = SimulatedModel(args.tokenizer or str(default_folder()), SimulatedPolicy(args.seed), args.delay)
    server = make_server(llm, args.host, args.port)
    print(f"{LABEL}\nlistening on http://{args.host}:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
