"""What the Python example agents share: their command line, their instructions and the calculator.

The examples run on their framework's own interpreter, where stepmill is usually not installed, so
nothing here imports stepmill: the calculator and the instructions are the shipped tool loop's
(stepmill/agents/tool_loop.py, standard library only), loaded from its file beside this folder, so every
example agent offers the same tool under the same name (``calculator(expression)``) as the tool loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

_spec = importlib.util.spec_from_file_location("stepmill_tool_loop", Path(__file__).resolve().parent.parent
                                               / "tool_loop.py")
_tool_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tool_loop)

INSTRUCTIONS = _tool_loop.SYSTEM  # "Solve the task. Use the calculator for arithmetic. End with … \boxed{}."


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / ** and parentheses).

    Args:
        expression: the arithmetic expression, for example 17 * (23 + 4).
    """
    return _tool_loop.run_tool("calculator", json.dumps({"expression": expression}))  # errors come back as text


def arguments(framework: str, argv=None) -> argparse.Namespace:
    """The command line every example takes: the task (or standard input), --model, --base-url, --max-turns,
    --max-tokens (a call's output cap: the recipes give {max_new_tokens}); the seed from STEPMILL_SEED, which
    the runner sets when [run] seed is."""
    parser = argparse.ArgumentParser(description=f"A calculator agent built with {framework}.")
    parser.add_argument("task", nargs="?", help="The task (default: standard input).")
    parser.add_argument("--model", default=os.environ.get("STEPMILL_MODEL", "gpt-4o-mini"))
    # The runner sets OPENAI_BASE_URL from [route] base_url; the calls go through HTTPS_PROXY (the run's tags).
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"))
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=None, help="What one call may generate.")
    args = parser.parse_args(argv)
    args.task = (args.task if args.task is not None else sys.stdin.read()).strip()
    args.api_key = os.environ.get("OPENAI_API_KEY", "sk-local")
    seed = os.environ.get("STEPMILL_SEED")
    args.seed = int(seed) if seed else None
    return args


def sampling(args: argparse.Namespace) -> dict:
    """What every call asks besides its messages: the output cap and the seed, where given."""
    given = {"max_tokens": args.max_tokens, "seed": args.seed}
    return {name: value for name, value in given.items() if value is not None}


def run(framework: str, package: str, answer: Callable[[argparse.Namespace], object], argv=None) -> int:
    """An example's main: its command line, then ``answer(args)`` (the framework's agent on the task, imported
    there), printed. A framework missing on this interpreter is said with how to install it."""
    args = arguments(framework, argv)
    try:
        output = answer(args)
    except ModuleNotFoundError as error:
        print(f"{framework} is not installed for {sys.executable} ({error}): pip install {package}, or run "
              "this example with the Python of the environment that has it", file=sys.stderr)
        return 3
    print(output)
    return 0
