"""Before a rollout's first run: whether each of its agents can fit the engine's context.

A CLI's opening prompt (its system prompt and tool declarations) is thousands of tokens before the task's
first word; an engine whose context is shorter refuses every first call, and some CLIs then say only
that something failed. The engine names its context (vLLM's and the simulated LLM's ``/v1/models`` give
``max_model_len``), each recipe states its opening prompt's size (``prompt_tokens``), and ``[run]
max_new_tokens`` what a call may add: a rollout whose agent cannot fit is refused here, with the numbers.
An engine that names no context (a hosted API) or cannot be asked is not judged: the runs say what happens.
"""

from __future__ import annotations

import json
import urllib.request

from stepmill.errors import ConfigError
from stepmill.runner.config import Config

ASK_TIMEOUT = 5.0  # seconds the engine's model list may take


def engine_context(base_url: str, model: str) -> int | None:
    """The engine's context length for ``model`` (or its only model), or None where it names none."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the engine itself, not a proxy
    try:
        with opener.open(base_url.rstrip("/") + "/models", timeout=ASK_TIMEOUT) as answer:
            listed = json.loads(answer.read()).get("data") or []
    except (OSError, ValueError, AttributeError):
        return None
    lengths = {entry.get("id"): entry.get("max_model_len") for entry in listed if isinstance(entry, dict)}
    length = lengths.get(model) if model in lengths else (next(iter(lengths.values())) if len(lengths) == 1 else None)
    return length if isinstance(length, int) and length > 0 else None


def check_context_fit(config: Config) -> None:
    """Raises ``ConfigError`` naming the agent and the numbers when opening prompt + max_new_tokens passes the
    engine's context."""
    sized = [config.agents[name] for name in config.run.agent if config.agents[name].prompt_tokens]
    if not sized or not config.route.base_url:
        return
    context = engine_context(config.route.base_url, config.run.model)
    if context is None:
        return
    new_tokens = config.run.max_new_tokens or 1  # at least the first token must fit
    for agent in sized:
        if agent.prompt_tokens + new_tokens > context:
            raise ConfigError(
                f"agent {agent.name!r} cannot fit the engine's context: its opening prompt is about "
                f"{agent.prompt_tokens} tokens (prompt_tokens) and a call may add {new_tokens} "
                f"([run] max_new_tokens), {agent.prompt_tokens + new_tokens} in all, but the engine at "
                f"{config.route.base_url} serves {config.run.model!r} with max_model_len {context}: serve it "
                f"with a longer context (vLLM: --max-model-len) or lower max_new_tokens")
