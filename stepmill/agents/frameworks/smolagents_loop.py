"""A calculator agent built with smolagents (`pip install "smolagents[openai]"`): its ToolCallingAgent, which
ends by calling its own final_answer tool.

The model is smolagents' OpenAIServerModel (chat completions on an `openai` client) at --base-url
(OPENAI_BASE_URL, which stepmill's runner sets from [route] base_url); the client's httpx takes HTTPS_PROXY
(the run's tags) and SSL_CERT_FILE. Its log goes to standard error, so standard output is the answer alone.

    python smolagents_loop.py --model qwen "What is 17 * 23?"
"""

from __future__ import annotations

import sys

from shared import INSTRUCTIONS, arguments, calculator, missing, sampling


def main(argv=None) -> int:
    args = arguments("smolagents", argv)
    try:
        from rich.console import Console
        from smolagents import AgentLogger, LogLevel, OpenAIServerModel, ToolCallingAgent, tool
    except ImportError as error:
        return missing("smolagents[openai]", error)
    model = OpenAIServerModel(model_id=args.model, api_base=args.base_url, api_key=args.api_key,
                              client_kwargs={"max_retries": 1}, **sampling(args))  # into every call
    agent = ToolCallingAgent(tools=[tool(calculator)], model=model, instructions=INSTRUCTIONS,
                             max_steps=args.max_turns,
                             logger=AgentLogger(LogLevel.INFO, Console(file=sys.stderr, highlight=False)))
    print(agent.run(args.task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
