"""On the event loop: exact token ids from open-model engines, for the calls ``HttpCapture`` recognised.

Asks an upstream once whether it is a vLLM or SGLang engine (``engine.EngineProbe``), adds the
id fields the agent did not ask for before the request moves, and takes out of the answer what
only that addition caused, before the answer moves. An Anthropic Messages call to an engine is
served through the engine's chat completions (which give ids) and answered as Messages. The
wire-format work itself is in ``engine`` and ``stepmill.protocols.messages_via_chat``; this is
the part that touches flows.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from stepmill.addon import engine
from stepmill.addon.loop_state import Capture, hook_failed
from stepmill.protocols import anthropic_messages, gemini_generate, gemini_via_chat, messages_via_chat, openai_chat
from stepmill.protocols.base import json_bytes

ENGINE_AUTH_HEADERS = ("authorization", "x-api-key", "api-key")


class EngineIds:
    def __init__(self):
        self.probe = engine.EngineProbe()

    # -- request ----------------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow, capture: Capture, forget: Callable[[http.HTTPFlow, Capture], None]):
        """None, or (the first call to a host whose probe is still to be made) a coroutine to await.
        ``forget``: drops a call that turns out to be no LLM call of ours."""
        native = engine.NATIVE_APIS.get(capture.call.api)  # an engine's own endpoint, e.g. SGLang's /generate
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
        if bare.endswith("/generate"):  # SGLang's native endpoint sits beside /v1
            root = bare[: -len("/generate")] + "/v1"
        elif gemini_generate.PATH.search(bare):  # …/v1beta/models/m:generateContent: the engine's /v1 beside it
            root = gemini_via_chat.chat_path(bare)[: -len("/chat/completions")]
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
            answer = await self.probe.ask(key, request.scheme, (request.host, request.port),
                                          request.host_header or request.host, key[4] + "/models", auth,
                                          self._upstream_ssl(), via=self._via(flow))
            native = engine.NATIVE_APIS.get(capture.call.api)
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
        """Only requests to engines are parsed on the loop: the fields must be added before bytes move."""
        request = flow.request
        try:
            body = json.loads(request.get_content(strict=False) or b"")
        except (ValueError, RecursionError):
            return  # the writer records it as the malformed request it is
        if not isinstance(body, dict):
            return
        if capture.call.api == anthropic_messages.API:
            self._messages_via_chat(flow, capture, body, kind)
            return
        if capture.call.api == gemini_generate.API:
            self._gemini_via_chat(flow, capture, body, kind)
            return
        capture.added = engine.inject(body, capture.call.api, "sglang" if kind == "sglang" else "vllm")
        if capture.added:
            request.set_content(json_bytes(body))

    @staticmethod
    def _messages_via_chat(flow: http.HTTPFlow, capture: Capture, body: dict, kind: str | bool) -> None:
        """The engine's chat completions, asked for ids, in place of its /v1/messages: the step records
        the chat exchange (exact ids); the agent gets it back as Messages."""
        request = flow.request
        path = request.path.split("?", 1)[0]
        if kind != "sglang":  # vLLM renders with its own template through /tokenize, at its root
            capture.render_with = f"{request.scheme}://{request.host}:{request.port}{path[: -len('/v1/messages')]}"
        if not ctx.options.stepmill_messages_via_chat:
            capture.notes.append("stepmill_messages_via_chat is off: the engine's /v1/messages gives no token ids")
            return
        try:
            chat = messages_via_chat.request_to_chat(body, engine="sglang" if kind == "sglang" else "vllm")
        except messages_via_chat.Untranslatable as exc:
            capture.notes.append(f"sent to the engine's /v1/messages as it came, which gives no token ids ({exc})")
            return
        capture.render_with = None  # served through chat: exact ids
        request.path = path[: -len("/messages")] + "/chat/completions"
        request.set_content(json_bytes(chat))
        capture.raw_request = request.raw_content or b""
        capture.call.api, capture.call.path = openai_chat.CHAT, request.path
        capture.translated = {"model": body.get("model"), "stop_sequences": body.get("stop_sequences")}
        capture.notes.append("an Anthropic Messages call, served through the engine's chat completions for "
                             "exact token ids; the agent got the answer as Messages")

    @staticmethod
    def _gemini_via_chat(flow: http.HTTPFlow, capture: Capture, body: dict, kind: str | bool) -> None:
        """An engine has no Gemini endpoint: its chat completions, asked for ids, serve the call, and the
        agent gets the answer back as Gemini's (SSE chunks, or an array of one for the JSON-array form)."""
        request = flow.request
        try:
            chat = gemini_via_chat.request_to_chat(body, request.path, engine="sglang" if kind == "sglang" else "vllm")
        except Exception as exc:  # a body of another shape: the writer records it as it is, with why
            capture.notes.append(f"sent to the engine as it came, which has no Gemini endpoint "
                                 f"({type(exc).__name__}: {exc})")
            return
        streamed = gemini_generate.streamed_path(request.path)
        request.path = gemini_via_chat.chat_path(request.path)
        request.set_content(json_bytes(chat))
        capture.raw_request = request.raw_content or b""
        capture.call.api, capture.call.path = openai_chat.CHAT, request.path
        capture.via = gemini_via_chat
        capture.translated = {"model": chat["model"]}
        if streamed and not chat.get("stream"):
            capture.translated["array"] = True
        capture.notes.append("a Gemini generateContent call, served through the engine's chat completions for "
                             "exact token ids; the agent got the answer as Gemini's")

    # -- response ---------------------------------------------------------------------------
    @staticmethod
    def stream_edits(capture: Capture) -> tuple[Callable[[dict], bool] | None, object | None]:
        """For a streamed answer: (what takes the added fields out of an event, the Messages translator)."""
        rewrite = translate = None
        if capture.added and ctx.options.stepmill_engine_strip:
            rewrite = lambda payload: engine.strip(payload, capture.added)  # noqa: E731
        if capture.translated is not None:
            translate = (capture.via or messages_via_chat).StreamTranslator(**capture.translated)
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
            payload = json.loads(response.get_content(strict=False) or b"")
            if isinstance(payload, dict) and engine.strip(payload, capture.added):
                response.set_content(json_bytes(payload))
        except Exception as exc:  # the agent gets the engine's body rather than none
            capture.notes.append(f"could not remove the engine fields: {exc}")

    @staticmethod
    def _translate_plain(response: http.Response, capture: Capture) -> None:
        """An engine's whole chat answer (or error) as the answer the agent asked for (Messages, Gemini)."""
        via = capture.via or messages_via_chat
        try:
            payload = json.loads(response.get_content(strict=False) or b"")
            translated = via.answer_of(payload, **capture.translated) \
                if response.status_code < 400 else via.error_body(payload)
        except Exception as exc:
            capture.notes.append(f"could not translate the engine's answer back: {exc}")
            translated = via.error_body({"message": f"stepmill could not translate the answer: {exc}"})
        response.set_content(json_bytes(translated))
        response.headers["content-type"] = "application/json"
