"""A local LLM upstream for the tests: OpenAI Chat/Completions/Responses (HTTP, SSE, WebSocket),
Anthropic Messages (HTTP, SSE), and a vLLM-like engine that returns token ids and logprobs.

Replies are deterministic functions of the request, so a tool loop runs without a model:
a user turn with tools gets a tool call, a tool result gets a final answer. Special model
names trigger the failure modes (see ``FAILURES``).

Like real servers, a stream lingers after its terminal event before the body ends (so clients
that close on ``[DONE]`` / ``response.completed`` cut the connection first), and only the engine
hosts (``ENGINE_HOSTS``) accept the engine-only request fields or say ``owned_by: "vllm"``:
every other host rejects unknown fields, as OpenAI and strict gateways do.

Token ids of the engine mode come from a byte-level toy tokenizer: each message renders as
``<role>`` + UTF-8 bytes of its text + END (id 256), the generation prompt is ``<assistant>``.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import json
import ssl
import threading
import uuid
from pathlib import Path

from aiohttp import WSMsgType, web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

END = 256
FAILURES = ("bad-json", "http-500", "too-long", "cut-stream", "gated-stream", "unknown-event", "ws-close")
TOO_LONG = ("This model's maximum context length is 4096 tokens. However, you requested 8000 output tokens and "
            "your prompt contains at least 10603 input tokens, for a total of at least 18603 tokens.")
ENGINE_HOSTS = ("engine.local", "127.0.0.1", "localhost", "sglang.local")
# sglang.local answers as SGLang's OpenAI server does: return_token_ids refused on streamed chat (400);
# return_input_ids_in_sglext / return_output_ids_in_sglext give sglext.input_ids and sglext.output_ids
# (one list per choice) in the body, or streamed in one final ``choices: []`` chunk before [DONE].
SGLANG_HOSTS = ("sglang.local",)
SGLEXT_FIELDS = ("return_input_ids_in_sglext", "return_output_ids_in_sglext")
ENGINE_FIELDS = ("return_token_ids", *SGLEXT_FIELDS)
LINGER = 0.5  # seconds a stream stays open after its terminal event
# Stream shapes, by model name prefix: each event written in two pieces, or the body compressed.
SPLIT, GZIP, BROTLI = "split-", "gzip-", "br-"


# -- TLS ---------------------------------------------------------------------------------------
def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for localhost, 127.0.0.1 and the public API names."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stepmill test upstream CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
          .not_valid_after(now + dt.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(n) for n in ("localhost", "api.openai.com", "api.anthropic.com", "engine.local",
                                       "gateway.local", "sglang.local")]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = folder / "upstream-ca.pem", folder / "upstream.pem", folder / "upstream-key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


# -- the toy engine tokenizer -------------------------------------------------------------------------
def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def render_ids(messages: list[dict]) -> list[int]:
    ids: list[int] = []
    for m in messages:
        text = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
        ids += encode_text(f"<{m.get('role')}>") + encode_text(text or "") + [END]
    return ids + encode_text("<assistant>")


def fake_logprobs(n: int) -> list[float]:
    return [-round(0.05 + 0.1 * (i % 7), 4) for i in range(n)]


# -- reply policy -----------------------------------------------------------------------------------
def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def decide(last_role: str, last_text: str, has_tools: bool) -> tuple[str, str | None]:
    """('tool', tool name) for a user turn with tools, else ('text', answer)."""
    if last_role == "user" and has_tools and "no tools" not in last_text:
        return "tool", "get_weather"
    if last_role == "tool":
        return "text", f"The tool said: {last_text[:60]}"
    return "text", f"Echo: {last_text[:80]}"


class StreamEncoder:
    """A compressed event stream, flushed after every event as servers with streaming compression do."""

    def __init__(self, name: str):
        import zlib

        import brotli

        self.name = name
        if name == "gzip":
            z = zlib.compressobj(6, zlib.DEFLATED, 31)
            self.chunk = lambda data: z.compress(data) + z.flush(zlib.Z_SYNC_FLUSH)
            self.finish = z.flush
        else:
            b = brotli.Compressor()
            self.chunk = lambda data: b.process(data) + b.flush()
            self.finish = b.finish

    @classmethod
    def for_model(cls, model: str) -> "StreamEncoder | None":
        if model.startswith(GZIP):
            return cls("gzip")
        if model.startswith(BROTLI):
            return cls("br")
        return None


class Upstream:
    def __init__(self, folder: Path):
        self.ca, self.cert, self.key = make_certs(folder)
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gates: dict[str, asyncio.Event] = {}
        self.requests: list[dict] = []  # bodies as received, for assertions on what reached upstream
        self._runner = None
        self._ready = threading.Event()
        self.received: dict[str, str] = {}  # X-Test-Case -> sha256 of the raw body that reached the upstream
        self._hostile_bodies: dict[str, bytes] = {}  # hostile answers, made once
        self.api_key: str | None = None  # set: every call must carry it as vLLM's --api-key wants (Bearer)

    # lifecycle
    def start(self) -> "Upstream":
        threading.Thread(target=self._run, daemon=True).start()
        if not self._ready.wait(15):
            raise RuntimeError("upstream did not start")
        return self

    def _run(self):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._hostile_middleware()])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses", self.responses_ws)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/generate", self.generate)
        app.router.add_post(r"/{version:v1[a-z]*}/models/{call:[^/]+}", self.gemini)
        self._runner = web.AppRunner(app)
        self.loop.run_until_complete(self._runner.setup())
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=context)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    def release(self, gate: str) -> None:
        """Let a gated stream send its remaining events."""
        self.loop.call_soon_threadsafe(self._gate(gate).set)

    def _gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    # helpers
    async def _body(self, request) -> dict | None:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            self.requests.append({"_malformed": raw.decode("utf-8", "replace")})
            return None
        self.requests.append(body)
        return body

    @staticmethod
    def _bad_request(message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=400)

    @staticmethod
    def is_engine_host(request) -> bool:
        return request.host.split(":")[0] in ENGINE_HOSTS

    @staticmethod
    def is_sglang(request) -> bool:
        return request.host.split(":")[0] in SGLANG_HOSTS

    async def models(self, request):
        owner = ("sglang" if self.is_sglang(request) else "vllm") if self.is_engine_host(request) else "openai"
        return web.json_response({"object": "list", "data": [{"id": "test-model", "object": "model", "created": 1,
                                                              "owned_by": owner}]})

    def _unknown_fields(self, request, body: dict) -> web.Response | None:
        """Strict servers (OpenAI, gateways) reject fields they do not know; engines take them."""
        unknown = [f for f in ENGINE_FIELDS if f in body]
        if unknown and not self.is_engine_host(request):
            return web.json_response({"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                                "type": "invalid_request_error"}}, status=400)
        return None

    async def _sse(self, request, events, *, model: str = "", cut_after: int | None = None, gate: str | None = None):
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        encoder = StreamEncoder.for_model(model)
        if encoder:
            headers["Content-Encoding"] = encoder.name
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)

        async def send(data: bytes):
            data = encoder.chunk(data) if encoder else data
            if model.startswith(SPLIT) and len(data) > 1:  # an event across two network writes
                await response.write(data[: len(data) // 2])
                await asyncio.sleep(0.02)
                data = data[len(data) // 2:]
            await response.write(data)

        for i, (name, data) in enumerate(events):
            if cut_after is not None and i == cut_after:
                request.transport.close()  # drop the connection mid-stream
                return response
            if gate is not None and i == 1:
                await self._gate(gate).wait()
            prefix = f"event: {name}\n" if name else ""
            payload = data if isinstance(data, str) else json.dumps(data)
            await send(f"{prefix}data: {payload}\n\n".encode())
        await asyncio.sleep(LINGER)  # the terminal event is out; the body ends a little later
        if encoder:
            await response.write(encoder.finish())
        try:
            await response.write_eof()
        except ConnectionError:
            pass  # the client already closed after the terminal event
        return response

    async def _failure(self, model: str):
        if model == "bad-json":
            return web.Response(text='{"id": "broken", "choices": [', content_type="application/json")
        if model == "http-500":
            return web.json_response({"error": {"message": "upstream exploded", "type": "server_error"}}, status=500)
        if model == "too-long":  # vLLM's refusal of a call that does not fit its context
            return web.json_response({"error": {"message": TOO_LONG, "type": "BadRequestError", "param": None,
                                                 "code": 400}}, status=400)
        return None

    # -- Google Gemini (generateContent, streamGenerateContent with and without alt=sse) ----------------
    async def gemini(self, request):
        version, call = request.match_info["version"], request.match_info["call"]
        model, _, method = call.partition(":")
        body = await self._body(request)
        if body is None or method not in ("generateContent", "streamGenerateContent"):
            return web.json_response({"error": {"code": 400, "message": "Invalid JSON payload received.",
                                                "status": "INVALID_ARGUMENT"}}, status=400)
        if model == "http-500":
            return web.json_response({"error": {"code": 500, "message": "upstream exploded", "status": "INTERNAL"}},
                                     status=500)
        chunks = gemini_chunks(body, model)
        if method == "generateContent":  # the whole answer in one response: the parts joined as the API does
            whole = {**chunks[-1], "candidates": [{**chunks[-1]["candidates"][0], "content": {"role": "model", "parts": []}}]}
            for chunk in chunks:
                for part in chunk["candidates"][0]["content"]["parts"]:
                    parts = whole["candidates"][0]["content"]["parts"]
                    if parts and "text" in part and set(parts[-1]) == set(part):
                        parts[-1] = {**parts[-1], "text": parts[-1]["text"] + part["text"]}
                    else:
                        parts.append(part)
            return web.json_response(whole)
        if request.query.get("alt") == "sse":
            return await self._stream(request, model, [(None, chunk) for chunk in chunks])
        # without alt=sse: one JSON array, written element by element as Google's servers do
        response = web.StreamResponse(headers={"Content-Type": "application/json; charset=UTF-8"})
        await response.prepare(request)
        for i, chunk in enumerate(chunks):
            await response.write((("[" if i == 0 else "\n,\r\n") + json.dumps(chunk, indent=2)).encode())
            await asyncio.sleep(0.005)
        await response.write(b"\n]")
        await response.write_eof()
        return response


    # -- OpenAI Chat Completions (and vLLM-style ids) ---------------------------------------------
    async def chat(self, request):
        body = await self._body(request)
        if body is None:
            return self._bad_request("could not parse the JSON body")
        model = body.get("model", "")
        failure = await self._failure(model) or self._unknown_fields(request, body)
        if failure:
            return failure
        messages = body.get("messages") or []
        last = messages[-1] if messages else {"role": "user", "content": ""}
        kind, value = decide(last.get("role"), _text_of(last.get("content")), bool(body.get("tools")))
        if model == "judge-test":  # a grader model: answers in the format it was asked for
            kind, value = "text", "Score: 8\nThe final answer follows from the tool output."
        rid = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        if kind == "tool":
            call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
                    "function": {"name": value, "arguments": json.dumps({"city": "Paris", "unit": "c"})}}
            message, finish, text = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", ""
        else:
            message, finish, text = {"role": "assistant", "content": value}, "stop", value
        engine = bool(body.get("return_token_ids"))
        sglext = {name.split("_")[1]: True for name in SGLEXT_FIELDS if body.get(name)} if self.is_sglang(request) else {}
        if engine and body.get("stream") and self.is_sglang(request):
            return self._bad_request("return_token_ids is not supported for streaming chat completions")
        prompt_ids = render_ids([{"role": m.get("role"), "content": _text_of(m.get("content")) or
                                  json.dumps(m.get("tool_calls"))} for m in messages])
        response_ids = encode_text(text or json.dumps(message.get("tool_calls"))) + [END]
        if "[[drift]]" in _text_of(last.get("content")) and response_ids:
            response_ids[0] = 1000 + response_ids[0]  # a sampled token the re-encoded text will not reproduce
        want_logprobs = bool(body.get("logprobs"))
        logprobs = fake_logprobs(len(response_ids) - (model == "qwen-bad-logprobs"))  # one short: a broken engine
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(response_ids),
                 "total_tokens": len(prompt_ids) + len(response_ids), "prompt_tokens_details": {"cached_tokens": 3}}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                               for t, lp in zip(response_ids, logprobs)]} if want_logprobs else None}
            payload = {"id": rid, "object": "chat.completion", "created": 1, "model": model, "choices": [choice],
                       "usage": usage}
            if engine:
                payload["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = response_ids
            outputs = [response_ids]
            for index in range(1, body.get("n") or 1):  # more samples of the same prompt
                other = f"{text} (sample {index})"
                outputs.append(encode_text(other) + [END])
                payload["choices"].append({"index": index, "message": {"role": "assistant", "content": other},
                                           "finish_reason": "stop", "logprobs": None,
                                           **({"token_ids": outputs[-1]} if engine else {})})
            if sglext:
                payload["sglext"] = {**({"input_ids": prompt_ids} if sglext.get("input") else {}),
                                     **({"output_ids": outputs} if sglext.get("output") else {})}
            return web.json_response(payload)
        chunks = []
        base = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": model}
        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        if engine:
            first["prompt_token_ids"] = prompt_ids
        chunks.append((None, first))
        if kind == "tool":
            call = message["tool_calls"][0]
            args = call["function"]["arguments"]
            pieces = [args[: len(args) // 2], args[len(args) // 2:]]
            chunks.append((None, {**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": call["id"], "type": "function", "function": {"name": value, "arguments": ""}}]},
                "finish_reason": None}]}))
            for piece in pieces:
                chunks.append((None, {**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "function": {"arguments": piece}}]}, "finish_reason": None}]}))
            id_groups = [response_ids]
        else:
            words = [text[i:i + 7] for i in range(0, len(text), 7)] or [""]
            id_groups, pos = [], 0
            for word in words:
                n = len(word.encode())
                id_groups.append(response_ids[pos:pos + n])
                pos += n
            id_groups[-1] = id_groups[-1] + response_ids[pos:]
            start = 0
            for word, ids in zip(words, id_groups):
                choice = {"index": 0, "delta": {"content": word}, "finish_reason": None}
                if engine:
                    choice["token_ids"] = ids
                if want_logprobs:
                    choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": logprobs[start + j],
                                                       "bytes": None, "top_logprobs": []} for j, t in enumerate(ids)]}
                start += len(ids)
                chunks.append((None, {**base, "choices": [choice]}))
            id_groups = []
        if kind == "tool" and engine:
            chunks[-1][1]["choices"][0]["token_ids"] = response_ids
        if kind == "tool" and want_logprobs:
            chunks[-1][1]["choices"][0]["logprobs"] = {"content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(response_ids, logprobs)]}
        final = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append((None, final))
            final = {**base, "choices": [], "usage": usage}
        chunks.append((None, final))
        if sglext:
            chunks.append((None, {**base, "choices": [], "sglext": {
                **({"input_ids": prompt_ids} if sglext.get("input") else {}),
                **({"output_ids": [response_ids]} if sglext.get("output") else {})}}))
        chunks.append((None, "[DONE]"))
        return await self._stream(request, model, chunks)

    # -- SGLang's native /generate (sglang.local): ids in, [logprob, id, text] per sampled token out --
    async def generate(self, request):
        if not self.is_sglang(request):
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await self._body(request)
        if body is None or ("text" not in body and "input_ids" not in body):
            return self._bad_request("either text or input_ids must be given")
        prompt = body.get("text")
        if prompt is None:
            prompt = bytes(i for i in body["input_ids"] if i < 256).decode("utf-8", "replace")
        text = f"gen: {prompt}"
        ids = encode_text(text) + [END]
        logprobs = fake_logprobs(len(ids))
        prompt_tokens = len(body["input_ids"]) if "input_ids" in body else len(encode_text(prompt))

        def meta(upto: int) -> dict:
            done = upto == len(ids)
            info = {"id": "sgl-gen-1", "finish_reason": {"type": "stop", "matched": END} if done else None,
                    "prompt_tokens": prompt_tokens, "completion_tokens": upto, "cached_tokens": 0}
            if body.get("return_logprob"):
                info["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs[:upto], ids[:upto])]
            return info

        if not body.get("stream"):
            return web.json_response({"text": text, "meta_info": meta(len(ids))})
        cuts = sorted({min(len(ids), n) for n in (3, 9, len(ids))})  # cumulative text and meta_info per event
        events = [(None, {"text": bytes(t for t in ids[:n] if t < 256).decode("utf-8", "replace"),
                          "meta_info": meta(n)}) for n in cuts]
        events.append((None, "[DONE]"))
        return await self._sse(request, events)

    async def _stream(self, request, model, events):
        if model == "cut-stream":
            return await self._sse(request, events, cut_after=2)
        if model.startswith("gated-stream"):
            return await self._sse(request, events, gate=model)
        return await self._sse(request, events, model=model)

    async def completions(self, request):
        body = await self._body(request)
        if body is None:
            return self._bad_request("could not parse the JSON body")
        failure = self._unknown_fields(request, body)
        if failure:
            return failure
        text = f"Completed: {str(body.get('prompt'))[:40]}"
        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                                  "created": 1, "model": body.get("model"),
                                  "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})

    # -- OpenAI Responses ---------------------------------------------------------------------------
    def _response_events(self, body: dict) -> tuple[list[dict], dict]:
        rid = f"resp_{uuid.uuid4().hex[:16]}"
        model = body.get("model", "")
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else (items or [])
        last = items[-1] if items else {"role": "user", "content": ""}
        if last.get("type") == "function_call_output":
            kind, value = "text", f"The tool said: {str(last.get('output'))[:60]}"
        else:
            kind, value = decide(last.get("role", "user"), _text_of(last.get("content")), bool(body.get("tools")))
        output = []
        if body.get("generate") is False:
            kind = "none"
        if kind != "none" and (body.get("reasoning") or {}).get("effort"):
            output.append({"id": f"rs_{uuid.uuid4().hex[:8]}", "type": "reasoning",
                           "summary": [{"type": "summary_text", "text": "Thinking about it."}],
                           "encrypted_content": "gAAAA-opaque"})
        if kind == "tool":
            output.append({"id": f"fc_{uuid.uuid4().hex[:8]}", "type": "function_call", "status": "completed",
                           "call_id": f"call_{uuid.uuid4().hex[:8]}", "name": value,
                           "arguments": json.dumps({"city": "Paris"})})
        elif kind == "text":
            output.append({"id": f"msg_{uuid.uuid4().hex[:8]}", "type": "message", "status": "completed",
                           "role": "assistant", "content": [{"type": "output_text", "text": value, "annotations": []}]})
        base = {"id": rid, "object": "response", "created_at": 1, "model": model, "output": [],
                "previous_response_id": body.get("previous_response_id"), "status": "in_progress",
                "instructions": body.get("instructions"), "tools": body.get("tools") or []}
        done = {**base, "status": "completed", "output": output,
                "usage": {"input_tokens": 20, "output_tokens": 7, "total_tokens": 27,
                          "input_tokens_details": {"cached_tokens": 10}, "output_tokens_details": {"reasoning_tokens": 0}}}
        events = [{"type": "response.created", "response": base}, {"type": "response.in_progress", "response": base}]
        for index, item in enumerate(output):
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress",
                                    **({"content": []} if item["type"] == "message" else {}),
                                    **({"arguments": ""} if item["type"] == "function_call" else {})}})
            if item["type"] == "message":
                text = item["content"][0]["text"]
                part = {"output_index": index, "content_index": 0, "item_id": item["id"]}
                events.append({"type": "response.content_part.added", **part,
                               "part": {"type": "output_text", "text": "", "annotations": []}})
                for i in range(0, len(text), 9):
                    events.append({"type": "response.output_text.delta", **part, "delta": text[i:i + 9]})
                events.append({"type": "response.output_text.done", **part, "text": text})
                events.append({"type": "response.content_part.done", **part, "part": item["content"][0]})
            elif item["type"] == "function_call":
                events.append({"type": "response.function_call_arguments.delta", "output_index": index,
                               "item_id": item["id"], "delta": item["arguments"]})
            events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        events.append({"type": "response.completed", "response": done})
        for n, event in enumerate(events):
            event["sequence_number"] = n
        return events, done

    async def responses(self, request):
        body = await self._body(request)
        if body is None:
            return self._bad_request("could not parse the JSON body")
        failure = await self._failure(body.get("model", ""))
        if failure:
            return failure
        events, done = self._response_events(body)
        if not body.get("stream"):
            return web.json_response(done)
        return await self._stream(request, body.get("model", ""), [(e["type"], e) for e in events])

    async def responses_ws(self, request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type != WSMsgType.TEXT:
                continue
            try:
                body = json.loads(message.data)
            except ValueError:
                continue  # a frame the server does not understand is ignored, as OpenAI's does
            if not isinstance(body, dict):
                continue
            self.requests.append(body)
            if body.get("type") != "response.create":
                continue
            events, _ = self._response_events(body)
            for i, event in enumerate(events):
                if body.get("model") == "ws-close" and i == 3:
                    await ws.close(code=1011, message=b"upstream gave up")
                    return ws
                await ws.send_str(json.dumps(event))
        return ws

    # -- Anthropic Messages ---------------------------------------------------------------------------
    async def messages(self, request):
        body = await self._body(request)
        if body is None:
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                  "message": "could not parse the JSON body"}}, status=400)
        model = body.get("model", "")
        failure = await self._failure(model)
        if failure:
            return failure
        messages = body.get("messages") or []
        last = messages[-1] if messages else {"role": "user", "content": ""}
        content = last.get("content")
        if isinstance(content, list) and any(b.get("type") == "tool_result" for b in content):
            result = next(b for b in content if b.get("type") == "tool_result")
            kind, value = "text", f"The tool said: {_text_of(result.get('content'))[:60]}"
        else:
            kind, value = decide("user", _text_of(content), bool(body.get("tools")))
        blocks = []
        if (body.get("thinking") or {}).get("type") == "enabled":
            blocks.append({"type": "thinking", "thinking": "Let me look at the weather tool.", "signature": "sig-" + uuid.uuid4().hex})
            blocks.append({"type": "redacted_thinking", "data": "opaque-redacted-bytes"})
        if kind == "tool":
            blocks.append({"type": "text", "text": "Checking."})
            blocks.append({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:10]}", "name": value,
                           "input": {"city": "Paris", "days": 2}})
            stop = "tool_use"
        else:
            blocks.append({"type": "text", "text": value})
            stop = "end_turn"
        mid = f"msg_{uuid.uuid4().hex[:16]}"
        usage = {"input_tokens": 30, "output_tokens": 12, "cache_read_input_tokens": 25, "cache_creation_input_tokens": 5}
        if not body.get("stream"):
            return web.json_response({"id": mid, "type": "message", "role": "assistant", "model": model,
                                      "content": blocks, "stop_reason": stop, "stop_sequence": None, "usage": usage})
        events = [("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 30, "output_tokens": 1, "cache_read_input_tokens": 25,
                                             "cache_creation_input_tokens": 5}}})]
        events.append(("ping", {"type": "ping"}))
        for index, block in enumerate(blocks):
            if block["type"] == "text":
                events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {"type": "text", "text": ""}}))
                text = block["text"]
                for i in range(0, len(text), 6):
                    events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "text_delta", "text": text[i:i + 6]}}))
            elif block["type"] == "thinking":
                events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
                events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "thinking_delta", "thinking": block["thinking"]}}))
                events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "signature_delta", "signature": block["signature"]}}))
            elif block["type"] == "redacted_thinking":
                events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": block}))
            elif block["type"] == "tool_use":
                events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {**block, "input": {}}}))
                raw = json.dumps(block["input"])
                for piece in (raw[:8], raw[8:]):
                    events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "input_json_delta", "partial_json": piece}}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        if model == "unknown-event":
            events.insert(3, ("mystery_event", {"type": "mystery_event", "payload": 1}))
        events.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": 12}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return await self._stream(request, model, events)

    # -- hostile answers (tests/test_hostile_bodies.py): see HOSTILE_ANSWERS -------------------------
    def _hostile_middleware(self):
        import hashlib

        @web.middleware
        async def hostile(request, handler):
            case, answer = request.headers.get("X-Test-Case"), request.headers.get("X-Hostile-Answer")
            if case is not None and not request.headers.get("Content-Encoding"):  # an encoded body: the engine's 400
                self.received[case] = hashlib.sha256(await request.read()).hexdigest()
            if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)  # as vLLM's --api-key answers
            if answer is None:
                return await handler(request)
            return await getattr(self, "_hostile_" + answer.replace("-", "_"))(request)

        return hostile

    async def _hostile_flood(self, request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tiny = b'data: {"choices":[]}\n\n' * 10_000
        for _ in range(FLOOD_EVENTS // 10_000):
            await response.write(tiny)
        await response.write(_sse_answer("flooded") + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _hostile_huge_event(self, request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event = json.dumps({"id": "huge", "object": "chat.completion.chunk", "model": "hostile", "prompt_token_ids": [1],
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "y" * HUGE_EVENT},
                                         "token_ids": [121], "finish_reason": None}]}).encode()
        for start in range(0, len(event), 1 << 20):
            await response.write((b"data: " if start == 0 else b"") + event[start:start + (1 << 20)])
        await response.write(b"\n\n" + _sse_answer("") + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _hostile_bomb(self, request, encoding: str):
        if encoding not in self._hostile_bodies:
            self._hostile_bodies[encoding] = await asyncio.to_thread(bomb, encoding)
        return web.Response(body=self._hostile_bodies[encoding],
                            headers={"Content-Type": "application/json", "Content-Encoding": encoding})

    async def _hostile_bomb_gzip(self, request):
        return await self._hostile_bomb(request, "gzip")

    async def _hostile_bomb_br(self, request):
        return await self._hostile_bomb(request, "br")

    async def _hostile_wrong_length(self, request):
        """Says 100000 bytes, sends 20, hangs up."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 100_000
        await response.prepare(request)
        await response.write(b'{"id": "short", "cho')
        request.transport.close()
        return response


def gemini_chunks(body: dict, model: str) -> list[dict]:
    """Google's Gemini API, as its servers stream it: each chunk a whole GenerateContentResponse of the parts
    since the last (text in pieces, a function call whole with its thoughtSignature, thoughts when asked
    for), usage on every chunk, the candidate's finishReason on the last. No ids: the API gives none."""
    contents = body.get("contents") or []
    last = contents[-1] if contents else {"role": "user", "parts": []}
    parts = last.get("parts") or []
    answer = next((p.get("functionResponse") or p.get("function_response") for p in parts
                   if "functionResponse" in p or "function_response" in p), None)
    if answer is not None:
        kind, value = "text", f"The tool said: {json.dumps(answer.get('response'))[:60]}"
    else:
        kind, value = decide("user", " ".join(str(p.get("text", "")) for p in parts), bool(body.get("tools")))
    def either(value: dict, camel: str, snake: str):  # the API takes both JSON spellings, and SDKs send both
        return (value or {}).get(camel, (value or {}).get(snake))

    thinking = either(either(either(body, "generationConfig", "generation_config"), "thinkingConfig", "thinking_config"),
                      "includeThoughts", "include_thoughts")
    pieces: list[list[dict]] = []
    if thinking:
        pieces += [[{"text": "Let me look at ", "thought": True}], [{"text": "the weather tool.", "thought": True}]]
    if kind == "tool":
        pieces.append([{"text": "Checking."}])
        pieces.append([{"functionCall": {"name": value, "args": {"city": "Paris", "days": 2}},
                        "thoughtSignature": base64.b64encode(b"sig-" + uuid.uuid4().bytes).decode()}])
    else:
        pieces += [[{"text": value[i:i + 6]}] for i in range(0, len(value), 6)]
    response_id = uuid.uuid4().hex[:20]
    chunks = []
    for i, piece in enumerate(pieces):
        candidate = {"content": {"role": "model", "parts": piece}, "index": 0}
        if i == len(pieces) - 1:
            candidate["finishReason"] = "STOP"
        chunks.append({"candidates": [candidate], "usageMetadata": {
            "promptTokenCount": 30, "candidatesTokenCount": 2 * (i + 1), "totalTokenCount": 30 + 2 * (i + 1),
            "thoughtsTokenCount": 4 if thinking else None}, "modelVersion": model, "responseId": response_id})
    return chunks


# -- hostile answers (tests/test_hostile_bodies.py) -----------------------------------------------------
# A request with ``X-Test-Case: NAME`` has the sha256 of its raw body kept in ``Upstream.received[NAME]``
# (what reached the engine, byte for byte); one with ``X-Hostile-Answer: KIND`` gets an answer no honest
# engine gives, whatever its body: KIND is one of HOSTILE_ANSWERS.
FLOOD_EVENTS = 1_000_000  # "flood": this many tiny events, then an answer and [DONE]
HUGE_EVENT = 50 * 1024 * 1024  # "huge-event": one event of this many bytes of content (with token ids)
BOMB = 256 * 1024 * 1024  # "bomb-gzip" / "bomb-br": a JSON answer that decodes to this many bytes
HOSTILE_ANSWERS = ("flood", "huge-event", "bomb-gzip", "bomb-br", "wrong-length")


BOMB_ANSWER = json.dumps({"id": "bomb", "object": "chat.completion", "model": "hostile", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "@"}, "finish_reason": "stop"}]}).encode()


def bomb(encoding: str, template: bytes = BOMB_ANSWER, size: int = BOMB) -> bytes:
    """``template`` with its ``@`` replaced by ``size`` zeros, compressed (``gzip`` or ``br``): under 300 KB."""
    import zlib

    import brotli

    before, after = template.split(b"@")
    if encoding == "gzip":
        z = zlib.compressobj(1, zlib.DEFLATED, 31)
        step, finish = z.compress, z.flush
    else:
        b = brotli.Compressor(quality=5)
        step, finish = b.process, b.finish
    zeros, parts = b"0" * (1 << 20), [step(before)]
    parts += [step(zeros) for _ in range(size >> 20)]
    return b"".join(parts + [step(after), finish()])


def _sse_answer(text: str) -> bytes:
    """The last events of an honest chat stream: ``text`` and the finish."""
    chunk = {"id": "h", "object": "chat.completion.chunk", "model": "hostile",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"
