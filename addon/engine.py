"""Exact token ids from open-model engines (vLLM, SGLang) behind the OpenAI paths.

The addon may ask the engine for ids and logprobs the agent did not ask for. What only that
addition caused is removed from the response the agent sees, so the agent behaves as if
nothing changed; what the agent asked for itself stays.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from dataclasses import dataclass

from stepmill.protocols import by_api

log = logging.getLogger("stepmill")

# Hosted APIs that are no engine of the user's: 'auto' never adds engine-only fields for them,
# since strict OpenAI-compatible services reject unknown request fields.
CLOSED_API_HOSTS = ("openai.com", "anthropic.com", "openai.azure.com", "googleapis.com", "openrouter.ai",
                    "together.xyz", "groq.com", "deepseek.com", "mistral.ai", "fireworks.ai", "x.ai")


@dataclass
class Added:
    token_ids: bool = False
    logprobs: bool = False
    response_messages: bool = False  # vLLM Responses: input_messages / output_messages with their tokens
    sglext: bool = False  # SGLang chat: sglext.input_ids / sglext.output_ids
    return_logprob: bool = False  # SGLang /generate: meta_info.output_token_logprobs

    def __bool__(self) -> bool:
        return self.token_ids or self.logprobs or self.response_messages or self.sglext or self.return_logprob


def configured(host: str, port: int | None, api: str, setting: str) -> bool | None:
    """What the setting alone says: True / False, or None when 'auto' must ask the host.

    ``setting`` is 'auto' (engines found by a probe), 'none', or a comma list of host[:port] (forced).
    """
    protocol = by_api(api)
    if protocol is None or not protocol.asks_engines:  # its own id fields, or served through the engine's chat
        return False
    setting = (setting or "").strip()
    if setting in ("", "none", "off"):
        return False
    host = (host or "").lower()
    if setting == "auto":
        if any(host == h or host.endswith("." + h) for h in CLOSED_API_HOSTS):
            return False
        return None
    wanted = {h.strip().lower() for h in setting.split(",") if h.strip()}
    return host in wanted or f"{host}:{port}" in wanted


# How Gemini and Messages agents send their key (Gemini also as ?key=); an engine started with --api-key
# checks only ``Authorization: Bearer``.
AGENT_KEY_HEADERS = ("x-goog-api-key", "x-api-key")


def bearer_of_agent_key(headers, path: str) -> dict:
    """``{"Authorization": "Bearer <key>"}`` for the key a Gemini or Messages agent sent its protocol's way,
    so the engine serving it through chat sees it; empty when the agent sent an Authorization or no key."""
    from urllib.parse import parse_qs

    if "authorization" in headers:
        return {}
    key = next((headers[name] for name in AGENT_KEY_HEADERS if headers.get(name)), None)
    if key is None:
        key = (parse_qs(path.partition("?")[2]).get("key") or [None])[0]
    return {"Authorization": f"Bearer {key}"} if key else {}


ENGINE_OWNERS = ("vllm", "sglang")
PROBE_TIMEOUT = 3.0


def models_say_engine(status: int, body: bytes) -> str | None:
    """vLLM and SGLang list their models with ``owned_by: "vllm"`` / ``"sglang"``: which one, or None."""
    if status != 200:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    data = payload.get("data") if isinstance(payload, dict) else None
    for model in data if isinstance(data, list) else []:
        owner = str(model.get("owned_by", "")).lower() if isinstance(model, dict) else ""
        if owner in ENGINE_OWNERS:
            return owner
    return None


class EngineProbe:
    """Asks each upstream once, off the request path, whether it is a vLLM or SGLang server.

    'auto' must never add a field to a request for a server that would reject it (an OpenAI-
    compatible gateway, an unlisted provider), so only a positive answer makes a host an engine.
    Concurrent first calls to a host share one probe; the answer is cached per host and base path,
    unless the engine refused the probe for the caller's key (a first call with a wrong key must not
    leave an engine recorded as "no engine" for every later call).
    """

    def __init__(self):
        self.answers: dict[tuple, str | bool] = {}  # "vllm" / "sglang", or False: no engine
        self.pending: dict[tuple, asyncio.Future] = {}

    def known(self, key: tuple) -> str | bool | None:
        return self.answers.get(key)

    async def ask(self, key: tuple, scheme: str, address: tuple[str, int], host_header: str, models_path: str,
                  auth: dict, ssl_context: ssl.SSLContext | None, via: tuple | None = None) -> str | bool:
        """``via``: the upstream proxy the flow itself goes through, (scheme, (host, port)), or None."""
        if key in self.answers:
            return self.answers[key]
        if key not in self.pending:
            self.pending[key] = asyncio.ensure_future(
                self._probe(scheme, address, host_header, models_path, auth, ssl_context, via))
        try:
            answer = await asyncio.shield(self.pending[key])
        finally:
            self.pending.pop(key, None)
        if answer is None:  # the engine refused the caller's key: no answer about the engine itself
            return False  # this call gets no ids; the next one (another key) asks again
        self.answers[key] = answer
        return answer

    async def _probe(self, scheme, address, host_header, models_path, auth, ssl_context, via) -> str | bool | None:
        """"vllm" / "sglang", False (no engine), or None: the probe was refused for the key it carried
        (401, 403), so whether this is an engine is not known yet."""
        try:
            status, body = await asyncio.wait_for(
                http_get(address, host_header, models_path, auth, ssl_context if scheme == "https" else None,
                         via=via), PROBE_TIMEOUT)
        except Exception as exc:  # unreachable, refused, TLS: not an engine we can vouch for
            log.info(f"stepmill: engine probe of {host_header}{models_path} failed ({exc!r}); not an engine")
            return False
        if status in (401, 403):  # a caller's wrong key says nothing about the engine: not remembered
            log.info(f"stepmill: engine probe of {host_header}{models_path} was refused ({status}) with the "
                     f"caller's key; asked again on the next call")
            return None
        answer = models_say_engine(status, body) or False
        log.info(f"stepmill: {host_header} is {'an engine (' + answer + ')' if answer else 'no engine'}: "
                 f"token ids {'will' if answer else 'will not'} be asked for")
        return answer


async def http_get(address: tuple[str, int], host_header: str, path: str, headers: dict,
                   ssl_context: ssl.SSLContext | None, limit: int = 1 << 20, via: tuple | None = None) -> tuple[int, bytes]:
    """A minimal HTTP/1.1 GET (the probe must not depend on an HTTP client the proxy does not ship).
    With ``via`` it goes the way the flow goes: through that upstream proxy (an absolute URI for
    http, CONNECT then TLS for https), so a host only the upstream proxy can resolve is reached."""
    target = path
    if via is None:
        reader, writer = await asyncio.open_connection(
            address[0], address[1], ssl=ssl_context, server_hostname=address[0] if ssl_context else None)
    else:
        proxy_scheme, (proxy_host, proxy_port) = via
        proxy_tls = ssl.create_default_context() if proxy_scheme == "https" else None
        reader, writer = await asyncio.open_connection(proxy_host, proxy_port, ssl=proxy_tls,
                                                       server_hostname=proxy_host if proxy_tls else None)
        if ssl_context is None:
            target = f"http://{address[0]}:{address[1]}{path}"
        else:
            writer.write(f"CONNECT {address[0]}:{address[1]} HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n\r\n"
                         .encode("latin-1", "replace"))
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            if int(head.split(b" ", 2)[1]) != 200:
                writer.close()
                raise ConnectionError(f"the upstream proxy refused CONNECT: {head.splitlines()[0]!r}")
            await writer.start_tls(ssl_context, server_hostname=address[0])
    try:
        lines = [f"GET {target} HTTP/1.1", f"Host: {host_header}", "Accept: application/json",
                 "Connection: close", "User-Agent: stepmill-engine-probe"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace"))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length is not None:  # a server that keeps the connection open despite "close"
            body = await reader.readexactly(min(length, limit))
        else:
            chunked = b"transfer-encoding: chunked" in head.lower()
            body = b""
            while len(body) < limit and not (chunked and (body.endswith(b"\r\n0\r\n\r\n") or body == b"0\r\n\r\n")):
                more = await reader.read(limit - len(body))
                if not more:
                    break
                body += more
            if chunked:
                body = _dechunk(body)
    finally:
        writer.close()
    return status, body


def _dechunk(body: bytes) -> bytes:
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)


def inject(body: dict, api: str, kind: str | bool = "vllm") -> Added:
    """Ask for ids and logprobs in place, the way the protocol (its ``engine_ids``) and engine ``kind`` allow;
    returns what was added."""
    added = Added()
    ids = by_api(api).engine_ids
    if ids == "generate":
        if not body.get("return_logprob"):
            body["return_logprob"] = True  # each sampled token as [logprob, id, text]
            added.return_logprob = True
        return added
    if ids == "responses":
        # vLLM answers the prompt's and the output's tokens as raw_message_tokens items (not in
        # background mode, which a recorded call never uses).
        if not body.get("enable_response_messages") and not body.get("background"):
            body["enable_response_messages"] = True
            added.response_messages = True
        return added
    if kind == "sglang" and ids == "chat":
        # SGLang refuses return_token_ids on streamed chat; its sglext flags work streamed or not.
        if not (body.get("return_input_ids_in_sglext") or body.get("return_output_ids_in_sglext")
                or body.get("return_token_ids")):
            body["return_input_ids_in_sglext"] = body["return_output_ids_in_sglext"] = True
            added.sglext = True
    elif not body.get("return_token_ids"):
        body["return_token_ids"] = True
        added.token_ids = True
    if ids == "chat":
        if not body.get("logprobs"):
            body["logprobs"] = True
            added.logprobs = True
    elif body.get("logprobs") is None:
        body["logprobs"] = 1
        added.logprobs = True
    return added


def strip(payload: dict, added: Added) -> bool:
    """Remove from a response (or stream chunk) what only ``added`` caused. True if changed."""
    changed = False
    if added.return_logprob and isinstance(payload.get("meta_info"), dict):
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs", "input_top_logprobs",
                    "output_token_ids_logprobs", "input_token_ids_logprobs"):
            if payload["meta_info"].pop(key, None) is not None:
                changed = True
        return changed
    if added.response_messages:
        for holder in (payload, payload.get("response")):  # a whole body, or a stream event's response
            if isinstance(holder, dict):
                for key in ("input_messages", "output_messages"):
                    if holder.get(key) is not None:
                        holder[key] = None  # as the engine answers when not asked: the field, empty
                        changed = True
        return changed
    if added.sglext and isinstance(payload.get("sglext"), dict):
        sglext = payload["sglext"]
        for key in ("input_ids", "output_ids"):
            if sglext.pop(key, None) is not None:
                changed = True
        if not sglext:
            del payload["sglext"]
            if payload.get("choices") == [] and not payload.get("usage"):
                payload.clear()  # the chunk only carried the ids: the agent never sees it
    # Not asked, vLLM still sends these fields, as null: the agent gets them so.
    if added.token_ids and payload.get("prompt_token_ids") is not None:
        payload["prompt_token_ids"] = None
        changed = True
    choices = payload.get("choices") or []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if added.token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if choice.get(key) is not None:
                    choice[key] = None
                    changed = True
        if added.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    if changed and choices and not payload.get("usage") and all(
            isinstance(c, dict) and not c.get("delta") and not c.get("text") and c.get("finish_reason") is None
            and c.get("logprobs") is None and "message" not in c for c in choices):
        # A chunk only the added fields filled (vLLM streams one per sampled token once asked for ids,
        # even while its tool parser holds the text back): the agent would not have got it.
        payload.clear()
    return changed


# Stream events that can carry what ``inject`` added: only these are parsed and rewritten.
MARKERS = ("token_ids", "logprobs", "input_messages", "output_messages", "sglext")  # "logprobs" covers /generate
