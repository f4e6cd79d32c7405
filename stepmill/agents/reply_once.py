"""A white-box agent that replies once: the task's prompt in Qwen's chat format, one generation of at
most ``max_tokens`` exact ids, no tools. The smallest policy loop there is, for tasks scored on a single
reply (the training demo's and tests' learnable task). Sampling is the engine's default (temperature
1), seeded by the runner's ``[run] seed`` when there is one."""

from __future__ import annotations


def run(task: dict, session, max_tokens: int = 48) -> str:
    prompt = str(task["prompt"]).strip()
    ids = session.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    return session.generate(ids, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}]).text
