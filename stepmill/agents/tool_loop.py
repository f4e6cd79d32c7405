"""A black-box agent: a plain `openai`-SDK tool loop with a calculator, run like any closed agent.

It knows nothing of stepmill: it talks to ``--base-url`` (through ``HTTPS_PROXY`` when the runner
sets it) and prints its final answer.

    echo "What is 17 * 23?" | python -m stepmill.agents.tool_loop --model qwen
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SYSTEM = "Solve the task. Use the calculator for arithmetic. End with the answer in \\boxed{}."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic only: numbers and operators, nothing else is evaluated."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("only arithmetic is allowed")

    return str(walk(ast.parse(expression, mode="eval").body))


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        if name != "calculator":
            return f"error: unknown tool {name!r}; the only tool is calculator"
        return calculate(str(args.get("expression", "")))
    except Exception as exc:  # the model sees the error and can try again
        return f"error: {exc}"


def main(argv=None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", nargs="?", help="The task (default: standard input).")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"))
    parser.add_argument("--model", default=os.environ.get("STEPMILL_MODEL", "gpt-4o-mini"))
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--seed", type=int, default=int(os.environ["STEPMILL_SEED"]) if os.environ.get("STEPMILL_SEED")
                        else None, help="Sampling seed of the first call (the next ones add their turn).")
    args = parser.parse_args(argv)
    task = args.task if args.task is not None else sys.stdin.read()
    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "sk-local"), max_retries=1)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.strip()}]
    for turn in range(args.max_turns):
        seeded = {} if args.seed is None else {"seed": args.seed + turn}
        message = client.chat.completions.create(model=args.model, messages=messages, tools=[CALCULATOR],
                                                 **seeded).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content or "")
            return 0
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    print("gave up: too many turns", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
