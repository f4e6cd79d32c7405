"""A white-box agent for the tests: one generation, then it waits (to be interrupted)."""

import time

from stepmill.agents.token_loop import run as token_loop


def generate_then_wait(task, session):
    ids = session.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    session.generate(ids, messages=[{"role": "user", "content": task["prompt"]}])
    time.sleep(120)
    return token_loop(task, session)


def report_task(task, session):
    """Says which task fields it was handed (its log), then runs as the shipped loop does."""
    import sys

    print(f"task fields: {sorted(task)}", file=sys.stderr)
    return token_loop(task, session)
