"""A SIMULATED LLM — no model at all — for the demo and the tests, clearly labelled as such.

It speaks the OpenAI protocol the way a vLLM server does (``/v1/models`` owned by ``vllm``,
``/v1/chat/completions`` and ``/v1/completions``, streamed or not, tool calls, ``n``, logprobs,
and vLLM's token-id fields ``return_token_ids`` → ``prompt_token_ids`` / ``token_ids``), and
tokenizes with the real Qwen2 vocabulary and chat template, so the ids it returns are what a
Qwen model served by vLLM would return for the same text.

What it "says" is decided by a seeded coin, not by a network: for an arithmetic task it calls
the calculator tool or answers directly, and is right only some of the time — so rollouts of
one task differ and rewards have something to tell apart.

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

MODEL = "stepmill-simulated-qwen"
LABEL = "stepmill simulated LLM (not a model: seeded coin flips over arithmetic, real Qwen2 token ids)"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_EXPRESSION = re.compile(r"[-+*/().\d\s]*\d[-+*/().\d\s]*[-+*/][-+*/().\d\s]*\d[-+*/().\d\s]*")
_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)


@dataclass
class Reply:
    text: str  # what the model generates, in Qwen's format (tool calls as <tool_call> blocks)
    tool_call: dict | None = None  # {"name", "arguments"} when the reply is a tool call


def find_expression(text: str) -> str | None:
    """The longest arithmetic expression in a task ('What is 17 * 23 + 4?' → '17 * 23 + 4')."""
    found = [m.group().strip().rstrip(".") for m in _EXPRESSION.finditer(text)]
    return max(found, key=len) if found else None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


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

    def reply(self, prompt: str, tools: bool) -> Reply:
        from stepmill.agents.tool_loop import calculate

        coins = self._coins(prompt)
        turns = prompt.split(IM_START)
        last = next((t for t in reversed(turns) if t.startswith(("user", "tool"))), "")
        result = _TOOL_RESPONSE.findall(last)
        if result:  # the calculator answered: report it, usually faithfully
            value = result[-1].strip()
            if coins.random() >= self.tool_accuracy:
                value = _slip(value, coins)
            return Reply(f"The calculator says {result[-1].strip()}, so the answer is \\boxed{{{value}}}.")
        expression = find_expression(last.split("\n", 1)[-1])
        if expression is None:
            return Reply("I can only do arithmetic. \\boxed{0}")
        if tools and coins.random() < self.tool_rate:
            arguments = {"expression": " ".join(expression.split())}
            call = json.dumps({"name": "calculator", "arguments": arguments})
            return Reply(f"<tool_call>\n{call}\n</tool_call>", {"name": "calculator", "arguments": arguments})
        try:
            value = calculate(expression)
        except (ValueError, ZeroDivisionError, SyntaxError, TypeError):
            return Reply("That expression does not compute. \\boxed{0}")
        value = _number(float(value))
        if coins.random() >= self.direct_accuracy:
            value = _slip(value, coins)
        return Reply(f"Working it out in my head: {expression} = {value}. \\boxed{{{value}}}")


def _slip(value: str, coins: random.Random) -> str:
    """A plausible wrong answer: off by a little."""
    try:
        number = float(value)
    except ValueError:
        return value + "0"
    return _number(number + coins.choice([-10, -2, -1, 1, 2, 10]))


class Engine:
    """Tokenizer + policy: the request in, the reply's text and exact ids out."""

    def __init__(self, tokenizer_folder: str, policy: SimulatedPolicy, delay: float = 0.0):
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
        self.end_id = self.tokenizer.convert_tokens_to_ids(IM_END)
        self.policy = policy
        self.delay = delay

    def render(self, messages: list[dict], tools: list | None) -> str:
        flat = [{**m, "content": _text_of(m.get("content"))} for m in messages]
        return self.tokenizer.apply_chat_template(flat, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompt: str, tools: bool, coins_prompt: str | None = None) -> tuple[Reply, list[int], list[float]]:
        reply = self.policy.reply(coins_prompt or prompt, tools)
        ids = self.encode(reply.text) + [self.end_id]  # the stop token is sampled too
        rng = random.Random(len(ids))
        logprobs = [round(-abs(rng.gauss(0, 0.4)), 4) for _ in ids]
        if self.delay:
            time.sleep(self.delay)
        return reply, ids, logprobs


def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


class BadRequest(ValueError):
    pass


def chat_completion(engine: Engine, body: dict) -> tuple[dict, list[dict]]:
    """The non-streamed answer and the chunks of the streamed one, for one chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of message objects")
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise BadRequest("n must be an integer from 1 to 16")
    prompt = engine.render(messages, body.get("tools"))
    prompt_ids = engine.encode(prompt)
    want_ids, want_logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
    rid, model = f"chatcmpl-sim-{uuid.uuid4().hex[:12]}", body.get("model") or MODEL
    base = {"id": rid, "created": int(time.time()), "model": model, "system_fingerprint": "stepmill-simulated"}
    choices, chunks, completion_tokens = [], [], 0
    for index in range(n):
        reply, ids, logprobs = engine.generate(prompt, bool(body.get("tools")))
        completion_tokens += len(ids)
        if reply.tool_call:
            call = {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {
                "name": reply.tool_call["name"], "arguments": json.dumps(reply.tool_call["arguments"])}}
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": reply.text}, "stop"
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": _chat_logprobs(engine, ids, logprobs) if want_logprobs else None}
        if want_ids:
            choice["token_ids"] = ids
        choices.append(choice)
        chunks.extend(_chat_chunks(engine, base, index, message, finish, ids, logprobs, want_ids, want_logprobs))
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
             "total_tokens": len(prompt_ids) + completion_tokens}
    payload = {**base, "object": "chat.completion", "choices": choices, "usage": usage}
    if want_ids:
        payload["prompt_token_ids"] = prompt_ids
        chunks[0]["prompt_token_ids"] = prompt_ids
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    return payload, chunks


def _chat_logprobs(engine: Engine, ids: list[int], logprobs: list[float]) -> dict:
    tokens = engine.tokenizer.convert_ids_to_tokens(ids)
    return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


def _chat_chunks(engine, base, index, message, finish, ids, logprobs, want_ids, want_logprobs) -> list[dict]:
    chunk = {**base, "object": "chat.completion.chunk"}
    out = [{**chunk, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}]}]
    if message.get("tool_calls"):
        pieces = [(ids, {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]})]
    else:  # four tokens an event, each with the text its tokens add
        pieces, said = [], ""
        for start in range(0, len(ids), 4):
            text = engine.tokenizer.decode(ids[:start + 4], skip_special_tokens=True)
            pieces.append((ids[start:start + 4], {"content": text[len(said):]}))
            said = text
    position = 0
    for group, delta in pieces:
        choice = {"index": index, "delta": delta, "finish_reason": None}
        if want_ids:
            choice["token_ids"] = group
        if want_logprobs:
            choice["logprobs"] = _chat_logprobs(engine, group, logprobs[position:position + len(group)])
        position += len(group)
        out.append({**chunk, "choices": [choice]})
    out.append({**chunk, "choices": [{"index": index, "delta": {}, "finish_reason": finish}]})
    return out


def completion(engine: Engine, body: dict) -> dict:
    """A /v1/completions answer; the prompt is text or token ids (token-in, token-out)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in prompt):
        if max(prompt) >= len(engine.tokenizer):
            raise BadRequest(f"token id {max(prompt)} is outside the vocabulary ({len(engine.tokenizer)})")
        prompt_ids = prompt
        text = engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    elif isinstance(prompt, str):
        text, prompt_ids = prompt, engine.encode(prompt)
    else:
        raise BadRequest("prompt must be a string or a list of token ids")
    reply, ids, logprobs = engine.generate(text, "<tools>" in text)
    choice = {"index": 0, "text": reply.text, "finish_reason": "stop",
              "logprobs": None if body.get("logprobs") is None else {
                  "tokens": engine.tokenizer.convert_ids_to_tokens(ids), "token_logprobs": logprobs,
                  "top_logprobs": None, "text_offset": None}}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = ids
    return {"id": f"cmpl-sim-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or MODEL, "system_fingerprint": "stepmill-simulated", "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)}}


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "stepmill-simulated-llm"

        def log_message(self, *args):  # quiet: the proxy records every call anyway
            pass

        def _json(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str):
            self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                return self._json(200, {"object": "list", "data": [
                    {"id": MODEL, "object": "model", "owned_by": "vllm", "created": 0, "root": MODEL,
                     "description": LABEL}]})
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
                    payload, chunks = chat_completion(engine, body)
                    return self._sse(chunks) if body.get("stream") else self._json(200, payload)
                if path.endswith("/completions"):
                    return self._json(200, completion(engine, body))
                return self._error(404, f"no route {self.path}")
            except (ValueError, BadRequest) as exc:
                return self._error(400, str(exc))

        def _sse(self, chunks: list[dict]):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the body ends when the connection does
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
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

    engine = Engine(args.tokenizer or str(default_folder()), SimulatedPolicy(args.seed), args.delay)
    server = make_server(engine, args.host, args.port)
    print(f"{LABEL}\nlistening on http://{args.host}:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
