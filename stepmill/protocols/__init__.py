"""The LLM protocols stepmill understands, found by request path."""

from __future__ import annotations

import re
from types import ModuleType

from stepmill.protocols import anthropic_messages, gemini_generate, openai_chat, openai_responses, sglang_generate
from stepmill.protocols.base import Completion, ParsedRequest, ProtocolError

# (path pattern, api name, module). Paths are matched without the query string, at the end,
# so a vLLM or SGLang server under any prefix is recognised.
ROUTES: list[tuple[re.Pattern, str, ModuleType]] = [
    (re.compile(r"/chat/completions$"), openai_chat.CHAT, openai_chat),
    (re.compile(r"/v1/completions$"), openai_chat.COMPLETIONS, openai_chat),
    (re.compile(r"/(v1|codex)/responses$"), openai_responses.API, openai_responses),
    (re.compile(r"/v1/messages$"), anthropic_messages.API, anthropic_messages),
    (gemini_generate.PATH, gemini_generate.API, gemini_generate),
    # SGLang's native endpoint, at the server's root (Ollama's /api/generate and the like are no match);
    # recorded only on hosts the probe (or the setting) says are SGLang.
    (re.compile(r"^/generate$"), sglang_generate.API, sglang_generate),
]


def match(path: str) -> tuple[str, ModuleType] | None:
    """The api name and parser module for a request path, or None for other traffic."""
    bare = path.split("?", 1)[0].rstrip("/")
    for pattern, api, module in ROUTES:
        if pattern.search(bare):
            return api, module
    return None


MODULES: dict[str, ModuleType] = {api: module for _, api, module in ROUTES}


def streams_json(api: str, path: str) -> bool:
    """True for a call whose protocol streams a JSON array, not events (Gemini's without ?alt=sse)."""
    module = MODULES.get(api)
    return hasattr(module, "streamed_path") and module.streamed_path(path)


__all__ = ["match", "streams_json", "MODULES", "ROUTES", "Completion", "ParsedRequest", "ProtocolError"]
