"""A white-box agent: a tool-using ReAct loop that works in token ids (Qwen's chat format).

It renders the conversation itself, sends the ids to the engine, appends exactly the ids the
engine sampled, then the encoded tool result, and asks again — one growing token sequence,
each generation a step with its exact ids. Run it through ``stepmill.agents.whitebox`` (the
rollout runner does), which submits the steps.
"""

from __future__ import annotations

import json

from stepmill.agents.tool_loop import CALCULATOR, run_tool

SYSTEM = "Solve the task. Use the calculator for arithmetic. End with the answer in \\boxed{}."


def system_turn(system: str, tools: list[dict]) -> str:
    """The system turn as Qwen's template renders it with tools (stepmill.qwen_vocab.QWEN_TEMPLATE)."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (f"<|im_start|>system\n{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user "
            "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call><|im_end|>\n")


def run(task: dict, session, max_turns: int = 6) -> str:
    prompt = str(task["prompt"]).strip()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    ids = session.encode(system_turn(SYSTEM, [CALCULATOR]) + f"<|im_start|>user\n{prompt}<|im_end|>\n"
                         "<|im_start|>assistant\n")
    for _ in range(max_turns):
        generation = session.generate(ids, messages=list(messages))
        ids = ids + generation.ids  # exactly what was sampled, never re-encoded
        messages.append(generation.message)
        calls = generation.message.get("tool_calls")
        if not calls:
            return generation.text
        results = ""
        for call in calls:
            result = run_tool(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            results += f"\n<tool_response>\n{result}\n</tool_response>"
        ids = ids + session.encode(f"\n<|im_start|>user{results}<|im_end|>\n<|im_start|>assistant\n")
    return "gave up: too many turns"
