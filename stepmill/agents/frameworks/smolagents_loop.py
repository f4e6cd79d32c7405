"""A calculator agent built with smolagents (`pip install "smolagents[openai]"`): its ToolCallingAgent, which
ends by calling its own final_answer tool.

The model is smolagents' OpenAIServerModel (chat completions on an `openai` client) at --base-url
(OPENAI_BASE_URL, which stepmill's runner sets from [route] base_url); the client's httpx takes HTTPS_PROXY
(the run's tags) and SSL_CERT_FILE. Its log goes to standard error, so standard output is the answer alone.

    echo "What is 17 * 23?" | python smolagents_loop.py --model qwen
"""

from __future__ import annotations

import sys

from shared import INSTRUCTIONS, calculator, run, sampling


def answer(args) -> str:
    from rich.console import Console
    from smolagents import AgentLogger, LogLevel, OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=args.model, api_base=args.base_url, api_key=args.api_key,
                              client_kwargs={"max_retries": 1}, **sampling(args))  # into every call
    agent = ToolCallingAgent(tools=[tool(calculator)], model=model, instructions=INSTRUCTIONS,
                             max_steps=args.max_turns,
                             logger=AgentLogger(LogLevel.INFO, Console(file=sys.stderr, highlight=False)))
    return agent.run(args.task)


if __name__ == "__main__":
    sys.exit(run("smolagents", '"smolagents[openai]"', answer))
