"""The base the training demo and the loop's tests start from: the random-weight tiny Qwen2 after a short
supervised warm start, so that RL has something to sharpen, as RL on a real model does.

Why: a random model's output embeddings share no direction for "animal" (or "word"), so a dozen replies
a version can only move it token by token, and the rewards it can move in ten steps are won by tricks
(one token repeated). After ``steps`` SFT steps on replies that list English words of which about
``share`` are animals, the model names a few animals among other words (``topic_words`` ≈ 0.2–0.3),
and GRPO on the bundled ``animals16`` prompts raises that against the paired control, which starts from
the same base. What the warm start teaches is only the mixture; which animals, how many and how often
is left to the RL run.

The spec is built here (stepmill's tokenizer and data) and trained on by the engine's own torch in
``write_random_qwen2``, so the engine venv needs nothing of stepmill.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

DATASET = "animals16.jsonl"
TOPIC = "animals"


def prompts() -> list[dict]:
    """The bundled animals16 tasks."""
    text = (resources.files("stepmill") / "data" / DATASET).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def spec(tokenizer_folder: Path, *, steps: int = 60, lr: float = 1e-2, share: float = 0.3, others: int = 300,
         seed: int = 0) -> dict:
    """What the engine-side warm start trains on: the prompts as the shipped agents render them (the
    white-box reply_once, the chat template with and without the black-box tool loop's system turn and
    tool), the topic's word ids and ``others`` other English words' ids (each one token after a space)."""
    from transformers import AutoTokenizer

    from stepmill.agents.tool_loop import CALCULATOR, SYSTEM
    from stepmill.rewards.functions import english_words, topic_word_lists

    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))

    def one_token(word: str) -> int | None:
        ids = tok.encode(" " + word, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    topic = sorted(topic_word_lists()[TOPIC])
    rest = sorted(w for w in english_words() if w not in topic_word_lists()[TOPIC])
    random.Random(seed).shuffle(rest)
    rendered = []
    for task in prompts():
        user = [{"role": "user", "content": task["prompt"]}]
        rendered.append(tok.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False))
        for messages, tools in ((user, None), ([{"role": "system", "content": SYSTEM}, *user], [CALCULATOR])):
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            rendered.append(tok.encode(text, add_special_tokens=False))
    on_topic = [i for i in map(one_token, topic) if i is not None]
    other = [i for i in map(one_token, rest) if i is not None][:others]
    return {"prompts": rendered, "on_topic": on_topic, "other": other, "share": share, "steps": steps, "lr": lr,
            "seed": seed, "eos": tok.convert_tokens_to_ids("<|im_end|>"), "pad": tok.convert_tokens_to_ids("<|endoftext|>")}


# Run by the engine's python inside write_random_qwen2: `model` (a Qwen2ForCausalLM) and `spec` are given.
TRAIN = r"""
def warm_start(model, spec):
    import random
    rng = random.Random(spec["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    model.train()
    for _ in range(spec["steps"]):
        rows = []
        for _ in range(16):
            reply = [rng.choice(spec["on_topic"]) if rng.random() < spec["share"] else rng.choice(spec["other"])
                     for _ in range(rng.randint(10, 20))] + [spec["eos"]]
            rows.append((rng.choice(spec["prompts"]), reply))
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), spec["pad"])
        mask = torch.zeros((len(rows), width))
        for i, (p, r) in enumerate(rows):
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            mask[i, len(p):len(p) + len(r)] = 1
        # logits at the reply's positions only: the prompts are most of each row, the vocabulary is 151,936
        hidden = model.model(ids).last_hidden_state[:, :-1][mask[:, 1:].bool()]
        logprobs = torch.log_softmax(model.lm_head(hidden).float(), -1)
        loss = -logprobs.gather(1, ids[:, 1:][mask[:, 1:].bool()][:, None]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()
"""
