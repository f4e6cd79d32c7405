"""On the event loop: exact token ids from open-model engines, for the calls ``HttpCapture`` recognised.

Asks an upstream once whether it is a vLLM or SGLang engine (``engine.EngineProbe``), adds the
id fields the agent did not ask for before the request moves, and takes out of the answer what
only that addition caused, before the answer moves. A call whose protocol has no id fields on an
engine (Anthropic Messages, Gemini: its ``Protocol.via_chat``) is served through the engine's chat
completions (which give ids) and answered in the agent's protocol. The wire-format work itself is in
``engine`` and the protocol's translation module; this is the part that touches flows.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from stepmill.addon import engine
from stepmill.addon.loop_state import Capture, hook_failed
from stepmill.protocols.base import json_bytes
from stepmill.protocols.openai_chat import CHAT_PROTOCOL
from stepmill.protocols.streams import decode_kept
from stepmill.protocols.via_chat import Malformed, refusal

ENGINE_AUTH_HEADERS = ("authorization", "x-api-key", "api-key")
TOO_BIG = "more than stepmill_max_body"  # in read_json's reason for a body too big to read on the loop
UNTOUCHED = "forwarded untouched"  # the start of the note on a request body the loop could not read


def read_json(raw: bytes | None, encoding: str | None, limit: int | None):
    """On the loop: (the JSON of a body as it came with its Content-Encoding, None), or (None, why it cannot
    be read): bigger than ``limit`` (stepmill_max_body) as sent or once decoded, an encoding that does not
    decode, not JSON (invalid UTF-8, a number of more digits than Python reads), nested too deep. An identity
    body (the usual case) is parsed as it is: nothing is copied or scanned first."""
    raw = raw or b""
    if limit and len(raw) > limit:
        return None, f"its {len(raw)} bytes are more than stepmill_max_body ({limit}) reads on the event loop"
    if encoding:
        raw, _, problem, cut = decode_kept(raw, encoding, None, limit or None)
        if problem or cut:
            return None, problem or f"it decodes ({encoding}) to more than stepmill_max_body ({limit}) bytes"
    try:
        return json.loads(raw), None
    except (ValueError, RecursionError, MemoryError) as exc:
        return None, _reason(exc)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "it is nested too deeply to parse"
    return f"it is not JSON Python reads ({type(exc).__name__}: {exc})"


class EngineIds:
    def __init__(self):
        self.probe = engine.EngineProbe()

    # -- request ----------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow, capture: Capture, forget: Callable[[http.HTTPFlow, Capture], None]):
        """None, or (the first call to a host whose probe is still to be made) a coroutine to await.
        ``forget``: drops a call that turns out to be no LLM call of ours."""
        native = capture.protocol.engine_native  # an engine's own endpoint, e.g. SGLang's /generate
        if not ctx.options.stepmill_engine_inject and not native:
            return None
        decision = engine.configured(capture.call.host, flow.request.port, capture.call.api,
                                     ctx.options.stepmill_engine_hosts)
        if decision is None:
            key = self._probe_key(flow, capture)
            decision = self.probe.known(key)
            if decision is None:
                return self._probe_then_inject(flow, capture, key, forget)
        if native and decision not in (native, True):
            forget(flow, capture)  # some other service's /generate: not an LLM call of ours
        elif decision and ctx.options.stepmill_engine_inject:
            self._inject(flow, capture, decision)
        return None

    @classmethod
    def _probe_key(cls, flow: http.HTTPFlow, capture: Capture) -> tuple:
        request = flow.request
        bare = request.path.split("?", 1)[0].rstrip("/")
        via = capture.protocol.via_chat
        if capture.protocol.engine_native:  # an engine's own endpoint (SGLang's /generate) sits beside /v1
            root = bare.rsplit("/", 1)[0] + "/v1"
        elif via is not None:  # …/v1beta/models/m:generateContent: the engine's /v1 beside it
            root = via.chat_path(bare)[: -len("/chat/completions")]
        elif bare.endswith("/chat/completions"):
            root = bare[: -len("/chat/completions")]
        else:
            root = bare.rsplit("/", 1)[0]
        return request.scheme, request.host, request.port, capture.call.host, root, cls._via(flow)

    @staticmethod
    def _via(flow: http.HTTPFlow) -> tuple | None:
        """The upstream proxy this flow goes through: one a script set on the flow, else the mode's."""
        if flow.server_conn.via is not None:  # a ServerSpec: (scheme, (host, port))
            scheme, address = flow.server_conn.via
            return scheme, tuple(address)
        mode = flow.client_conn.proxy_mode
        if isinstance(mode, mode_specs.UpstreamMode):
            return mode.scheme, mode.address
        return None

    async def _probe_then_inject(self, flow: http.HTTPFlow, capture: Capture, key: tuple, forget) -> None:
        try:
            request = flow.request
            auth = {k: v for k, v in request.headers.items() if k.lower() in ENGINE_AUTH_HEADERS}
            if capture.protocol.via_chat is not None:
                auth.update(engine.bearer_of_agent_key(request.headers, request.path))
            answer = await self.probe.ask(key, request.scheme, (request.host, request.port),
                                          request.host_header or request.host, key[4] + "/models", auth,
                                          self._upstream_ssl(), via=self._via(flow))
            native = capture.protocol.engine_native
            if native and answer != native:
                forget(flow, capture)
            elif answer and ctx.options.stepmill_engine_inject:
                self._inject(flow, capture, answer)
        except Exception:
            hook_failed("request")

    @staticmethod
    def _upstream_ssl() -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=ctx.options.ssl_verify_upstream_trusted_ca or None)
        if ctx.options.ssl_insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def _inject(self, flow: http.HTTPFlow, capture: Capture, kind: str | bool = True) -> None:
        """Only requests to engines are parsed on the loop: the fields must be added before bytes move. A body
        the loop cannot read or write back goes as it came, and the step says so (the writer says what is wrong
        with it)."""
        request = flow.request
        body, why = read_json(request.raw_content, capture.record.request_encoding, ctx.options.stepmill_max_body)
        if why is None and not isinstance(body, dict):
            why = f"it is JSON but not an object ({type(body).__name__})"
        via = capture.protocol.via_chat
        if why is not None:
            # Messages has the engine's own endpoint: a body too big to read here (or all of them, with the
            # translation off) goes there; any other is one no route of the engine's can serve
            own_endpoint = via is not None and via.ENGINE_ENDPOINT and (
                TOO_BIG in why or not ctx.options.stepmill_messages_via_chat)
            if via is not None and not own_endpoint:
                self._refuse(flow, capture, f"the request body cannot be read: {why}")
                return
            capture.record.notes.append(f"{UNTOUCHED} (no token ids asked for): {why}")
            return
        if via is not None:
            self._via_chat(flow, capture, body, kind)
            return
        added = engine.inject(body, capture.call.api, "sglang" if kind == "sglang" else "vllm")
        if added:
            try:
                content = json_bytes(body)
            except (ValueError, RecursionError) as exc:  # NaN is written back as it came; depth may not be
                capture.record.notes.append(f"{UNTOUCHED} (no token ids asked for): {_reason(exc)}")
                return
            request.set_content(content)
            capture.added = added

    @staticmethod
    def _via_chat(flow: http.HTTPFlow, capture: Capture, body: dict, kind: str | bool) -> None:
        """The engine's chat completions, asked for ids, serve a protocol it gives no ids for (Messages) or has
        no endpoint for (Gemini): the step records the chat exchange (exact ids) under the agent's api, with
        ``engine_api`` openai.chat; the agent gets the answer back in its own protocol."""
        request = flow.request
        via = capture.protocol.via_chat
        if via.ENGINE_ENDPOINT:  # the engine answers the call itself when it is not translated
            if kind != "sglang":  # vLLM renders with its own template through /tokenize, at its root
                root = via.chat_path(request.path)[: -len("/v1/chat/completions")]
                capture.record.render_with = f"{request.scheme}://{request.host}:{request.port}{root}"
            if not ctx.options.stepmill_messages_via_chat:
                capture.record.notes.append(
                    "stepmill_messages_via_chat is off: the engine's own endpoint gives no token ids")
                return
        try:
            translated = via.translate(body, request.path, "sglang" if kind == "sglang" else "vllm")
            content = json_bytes(translated.chat)
        except Exception as exc:  # a request chat cannot carry, or a body of another shape
            if isinstance(exc, Malformed) or not via.ENGINE_ENDPOINT:  # no route of the engine's would take it
                EngineIds._refuse(flow, capture, f"it cannot be served through the engine's chat completions "
                                                 f"({type(exc).__name__}: {exc})")
                return
            why = "its own endpoint gives no token ids" if via.ENGINE_ENDPOINT else \
                "it has no endpoint for this protocol"
            capture.record.notes.append(f"sent to the engine as it came, and {why} ({type(exc).__name__}: {exc})")
            return
        capture.record.render_with = None  # served through chat: exact ids
        request.headers.update(engine.bearer_of_agent_key(request.headers, request.path))
        request.path = translated.path
        request.set_content(content)
        capture.raw_request = request.raw_content or b""
        capture.call.engine_api, capture.call.path = CHAT_PROTOCOL.api, request.path
        capture.protocol = CHAT_PROTOCOL  # what is on the wire from here on
        capture.via, capture.translated = via, translated.options
        capture.record.notes += [via.NOTE, *translated.notes]

    @staticmethod
    def _refuse(flow: http.HTTPFlow, capture: Capture, reason: str) -> None:
        """The proxy's own 400, in the agent's protocol, for a call it cannot translate: never sent to a route
        the engine does not have (or would misread); the step records the refusal once, as an error."""
        flow.response = http.Response.make(400, refusal(capture.protocol.via_chat, reason),
                                           {"Content-Type": "application/json"})

    # -- response ---------------------------------------------------------------------------
    @staticmethod
    def stream_edits(capture: Capture) -> tuple[Callable[[dict], bool] | None, object | None]:
        """For a streamed answer: (what takes the added fields out of an event, the Messages translator)."""
        rewrite = translate = None
        if capture.added and ctx.options.stepmill_engine_strip:
            rewrite = lambda payload: engine.strip(payload, capture.added)  # noqa: E731
        if capture.translated is not None:
            translate = capture.via.StreamTranslator(**capture.translated)
        return rewrite, translate

    @staticmethod
    def whole_body(response: http.Response, capture: Capture, error: str | None) -> None:
        """A whole answer, before it moves: the added fields out, a chat answer back to Messages."""
        if capture.added and ctx.options.stepmill_engine_strip and response.status_code < 400 and error is None:
            EngineIds._strip_plain(response, capture)
        if capture.translated is not None:
            EngineIds._translate_plain(response, capture)

    @staticmethod
    def _strip_plain(response: http.Response, capture: Capture) -> None:
        """An engine's whole body: the fields only stepmill asked for are taken out before it moves."""
        try:
            payload, why = read_json(response.raw_content, capture.record.response_encoding,
                                     ctx.options.stepmill_max_body)
            if why is not None:
                capture.record.notes.append(f"could not remove the engine fields, the answer went as it came: {why}")
            elif isinstance(payload, dict) and engine.strip(payload, capture.added):
                response.set_content(json_bytes(payload))
        except Exception as exc:  # the agent gets the engine's body rather than none
            capture.record.notes.append(f"could not remove the engine fields: {_reason(exc)}")

    @staticmethod
    def _translate_plain(response: http.Response, capture: Capture) -> None:
        """An engine's whole chat answer (or error) as the answer the agent asked for (Messages, Gemini)."""
        via = capture.via
        try:
            payload, why = read_json(response.raw_content, capture.record.response_encoding,
                                     ctx.options.stepmill_max_body)
            if why is not None:
                raise ValueError(why)
            translated = via.answer_of(payload, **capture.translated) \
                if response.status_code < 400 else via.error_body(payload, response.status_code)
        except Exception as exc:
            capture.record.notes.append(f"could not translate the engine's answer back: {exc}")
            translated = via.error_body({"message": f"stepmill could not translate the answer: {exc}"})
        response.set_content(json_bytes(translated))
        response.headers["content-type"] = "application/json"
