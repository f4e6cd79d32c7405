"""A calculator agent built with PydanticAI (`pip install "pydantic-ai-slim[openai]"`), run by its own Agent.

Its model is PydanticAI's OpenAIChatModel (chat completions) with an OpenAIProvider at --base-url
(OPENAI_BASE_URL, which stepmill's runner sets from [route] base_url); the provider's httpx client takes
HTTPS_PROXY (the run's tags) and SSL_CERT_FILE.

    echo "What is 17 * 23?" | python pydantic_ai_loop.py --model qwen
"""

from __future__ import annotations

import sys

from shared import INSTRUCTIONS, calculator, run, sampling


def answer(args) -> str:
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(args.model, provider=OpenAIProvider(base_url=args.base_url, api_key=args.api_key))
    agent = Agent(model, instructions=INSTRUCTIONS, tools=[calculator],
                  model_settings=sampling(args))  # PydanticAI names them alike
    return agent.run_sync(args.task, usage_limits=UsageLimits(request_limit=args.max_turns)).output


if __name__ == "__main__":
    sys.exit(run("PydanticAI", '"pydantic-ai-slim[openai]"', answer))
