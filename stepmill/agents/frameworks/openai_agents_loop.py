"""A calculator agent built with the OpenAI Agents SDK (`pip install openai-agents`), run by its own Runner.

Its model is the SDK's chat-completions model on an `openai` client at --base-url (OPENAI_BASE_URL, which
stepmill's runner sets from [route] base_url); the client's httpx takes HTTPS_PROXY (the run's tags) and
SSL_CERT_FILE. Tracing is off: it would upload every run to OpenAI's trace endpoint.

    echo "What is 17 * 23?" | python openai_agents_loop.py --model qwen
"""

from __future__ import annotations

import sys

from shared import INSTRUCTIONS, calculator, run, sampling


def answer(args) -> str:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=1)
    agent = Agent(name="calculator agent", instructions=INSTRUCTIONS, tools=[function_tool(calculator)],
                  model=OpenAIChatCompletionsModel(model=args.model, openai_client=client),
                  model_settings=ModelSettings(extra_args=sampling(args) or None))
    return Runner.run_sync(agent, args.task, max_turns=args.max_turns).final_output


if __name__ == "__main__":
    sys.exit(run("the OpenAI Agents SDK", "openai-agents", answer))
