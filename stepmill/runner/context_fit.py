"""Before a rollout's first run: whether each of its agents can fit the engine's context.

A CLI's opening prompt (its system prompt and tool declarations) is thousands of tokens before the task's
first word; an engine whose context is shorter refuses every first call, and some CLIs then say only
that something failed. The engine names its context (vLLM's and the simulated LLM's ``/v1/models`` give
``max_model_len``), each recipe states its opening prompt's size (``prompt_tokens``), and ``[run]
max_new_tokens`` what a call may add: a rollout whose agent cannot fit is refused here, with the numbers.
An engine that names no context (a hosted API) or cannot be asked is not judged: the runs say what happens.

The same numbers give each run's ``{max_new_tokens}`` (``new_tokens``), the output cap a recipe hands its
CLI: a CLI left to its own asks for 8k to 32k tokens a call (Qwen Code retries with 64k), past a small
engine's context.
"""

from __future__ import annotations

import json
import urllib.request

from stepmill.errors import ConfigError
from stepmill.runner.config import Config

ASK_TIMEOUT = 5.0  # seconds the engine's model list may take
# A call's output cap where [run] max_new_tokens is unset: enough for a tool call or an answer of pages,
# short of what CLIs ask on their own (8k to 32k), which a small engine's context cannot hold.
DEFAULT_NEW_TOKENS = 4096


def engine_context(base_url: str, model: str) -> int | None:
    """The engine's context length for ``model`` (or its only model), or None where it names none."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the engine itself, not a proxy
    try:
        with opener.open(base_url.rstrip("/") + "/models", timeout=ASK_TIMEOUT) as answer:
            listed = json.loads(answer.read()).get("data") or []
    except (OSError, ValueError, AttributeError):
        return None
    entries = {entry.get("id"): entry for entry in listed if isinstance(entry, dict)}
    # vLLM lists a LoRA adapter without a length of its own; its parent (the base model) has it.
    lengths = {name: entry.get("max_model_len") or entries.get(entry.get("parent"), {}).get("max_model_len")
               for name, entry in entries.items()}
    length = lengths.get(model) if model in lengths else (next(iter(lengths.values())) if len(lengths) == 1 else None)
    return length if isinstance(length, int) and length > 0 else None


def new_tokens(max_new_tokens: int | None, prompt_tokens: int | None, context: int | None) -> int:
    """What one call may add (``{max_new_tokens}``): ``[run] max_new_tokens`` where set; else what the engine's
    context leaves after the opening prompt, at most ``DEFAULT_NEW_TOKENS`` (a conversation grows: the whole
    rest of the context for one call would make its next call too long); ``DEFAULT_NEW_TOKENS`` where the
    engine names no context. An agent that states no ``prompt_tokens`` is given half the context at most.
    Never under 1: a prompt that leaves no room is refused by ``check_context_fit``."""
    if max_new_tokens:
        return max_new_tokens
    if context is None:
        return DEFAULT_NEW_TOKENS
    room = context - prompt_tokens if prompt_tokens else context // 2
    return max(1, min(DEFAULT_NEW_TOKENS, room))


def check_context_fit(config: Config) -> None:
    """Raises ``ConfigError`` naming the agent and the numbers when opening prompt + what a call may add
    (``new_tokens``: at least one token where ``[run] max_new_tokens`` is unset) passes the engine's context."""
    sized = [config.agents[name] for name in config.run.agent if config.agents[name].prompt_tokens]
    if not sized or not config.route.base_url:
        return
    context = engine_context(config.route.base_url, config.run.model)
    if context is None:
        return
    said, lower = (("[run] max_new_tokens", " or lower max_new_tokens") if config.run.max_new_tokens
                   else ("the least a call adds; [run] max_new_tokens is unset", ""))
    for agent in sized:
        adds = new_tokens(config.run.max_new_tokens, agent.prompt_tokens, context)
        if agent.prompt_tokens + adds > context:
            raise ConfigError(
                f"agent {agent.name!r} cannot fit the engine's context: its opening prompt is about "
                f"{agent.prompt_tokens} tokens (prompt_tokens) and a call may add {adds} "
                f"({said}), {agent.prompt_tokens + adds} in all, but the engine at "
                f"{config.route.base_url} serves {config.run.model!r} with max_model_len {context}: serve it "
                f"with a longer context (vLLM: --max-model-len){lower}")
