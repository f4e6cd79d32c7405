"""Exact token ids from open-model engines (vLLM, SGLang) behind the OpenAI paths.

The addon may ask the engine for ids and logprobs the agent did not ask for. What only that
addition caused is removed from the response the agent sees, so the agent behaves as if
nothing changed; what the agent asked for itself stays.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocols import openai_chat

# Hosted APIs that are no engine of the user's: 'auto' never adds engine-only fields for them,
# since strict OpenAI-compatible services reject unknown request fields.
CLOSED_API_HOSTS = ("openai.com", "anthropic.com", "openai.azure.com", "googleapis.com", "openrouter.ai",
                    "together.xyz", "groq.com", "deepseek.com", "mistral.ai", "fireworks.ai", "x.ai")
ENGINE_APIS = (openai_chat.CHAT, openai_chat.COMPLETIONS)


@dataclass
class Added:
    token_ids: bool = False
    logprobs: bool = False

    def __bool__(self) -> bool:
        return self.token_ids or self.logprobs


def is_engine(host: str, port: int | None, api: str, setting: str) -> bool:
    """``setting`` is 'auto' (any host but the closed APIs), 'none', or a comma list of host[:port]."""
    if api not in ENGINE_APIS:
        return False
    setting = (setting or "").strip()
    if setting in ("", "none", "off"):
        return False
    host = (host or "").lower()
    if setting == "auto":
        return not any(host == h or host.endswith("." + h) for h in CLOSED_API_HOSTS)
    wanted = {h.strip().lower() for h in setting.split(",") if h.strip()}
    return host in wanted or f"{host}:{port}" in wanted


def inject(body: dict, api: str) -> Added:
    """Ask for ids and logprobs in place; returns what was added."""
    added = Added()
    if not body.get("return_token_ids"):
        body["return_token_ids"] = True
        added.token_ids = True
    if api == openai_chat.CHAT:
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
    if added.token_ids and "prompt_token_ids" in payload:
        del payload["prompt_token_ids"]
        changed = True
    for choice in payload.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if added.token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if key in choice:
                    del choice[key]
                    changed = True
        if added.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed
