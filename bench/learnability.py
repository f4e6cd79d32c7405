"""Can the tiny random-weight Qwen2 learn a reward in a few GRPO steps at all? A pure-torch probe,
beside its paired control, without the proxy, the engine or the runner: the same model as the demo's
(hidden 128, 2 layers, the real 151,936-token vocabulary, tied or not), HF sampling at temperature 1,
the bundled ``words16`` prompts (``animals16`` for ``animals``), one GRPO step (token-mean, group-normalised advantages, AdamW) per
version. It shows which rewards a random model can move in ~10 steps and *how*: a sample of the
replies is printed at the middle and the end, so a reward won by a trick (one token repeated) is seen.

Rewards: ``letters`` (share of ASCII letters: learnable, and won by repeating one token), ``distinct``
(letters in first occurrences of words: won by one long word without spaces), ``diverse``
(``stepmill.rewards.functions:letters_diverse``), ``animals`` (``topic_words`` on the bundled
``animals16`` prompts, which then replace ``words16``). ``WARM=1`` starts from the warm-started base the
training demo and the loop's tests use (stepmill.demo.warm_start, the same spec and code), run and
control alike.

    .ci/python-torch bench/learnability.py REWARD LR STEPS N TASKS SEED TIED
    .ci/python-torch bench/learnability.py letters 6e-2 10 8 3 1 1     # 0.67 -> 1.00: "caffold" x 48
    .ci/python-torch bench/learnability.py diverse 3e-2 12 8 3 1 1     # rises, then collapses and falls
    WARM=1 .ci/python-torch bench/learnability.py animals 5e-3 10 4 3 3 1   # 0.15 -> 0.25, control 0.16 (+0.069)
"""
import json, math, re, sys, time
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from stepmill.qwen_vocab import default_folder
from stepmill.rewards import functions as F

reward_name, lr, steps, n, tasks, seed, tied = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
MAXT = 48
tok = AutoTokenizer.from_pretrained(str(default_folder()))
torch.manual_seed(0)
config = Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32768,
                     tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151645)
from importlib import resources
data = "animals16.jsonl" if reward_name == "animals" else "words16.jsonl"
lines = [json.loads(l) for l in (resources.files("stepmill") / "data" / data).read_text().splitlines()][:tasks]
prompts = [tok.apply_chat_template([{"role": "user", "content": l["prompt"]}], add_generation_prompt=True, tokenize=True) for l in lines]
prompts = [list(p["input_ids"]) if not isinstance(p, list) else p for p in prompts]
_L = re.compile(r"[A-Za-z]+")

def letters(text):
    return sum(c.isascii() and c.isalpha() for c in text) / max(1, len(text))

def letters_distinct(text, min_chars=48):
    words = _L.findall(text)
    seen, credit = set(), 0
    for w in words:
        if w.lower() not in seen:
            seen.add(w.lower()); credit += len(w)
    return credit / max(1, len(text)) * min(1.0, len(text) / min_chars)

def diverse(text):
    return F.letters_diverse({"completion": {"content": text}})[0]

def animals(text):
    return F.topic_words({"completion": {"content": text}, "metadata": {"topic": "animals"}})[0]

R = {"letters": letters, "distinct": letters_distinct, "diverse": diverse, "animals": animals}[reward_name]

import os
WARM = os.environ.get("WARM", "0") == "1"
if WARM:
    from stepmill.demo import warm_start
    from stepmill.qwen_vocab import default_folder as _vocab
    SPEC = warm_start.spec(_vocab())
    exec(warm_start.TRAIN)

def warm(model):
    if WARM:
        print("warm loss", warm_start(model, SPEC), flush=True)  # noqa: F821 (defined by TRAIN)

def run(update):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    warm(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        seqs, rewards, plens = [], [], []
        model.eval()
        with torch.no_grad():
            for p in prompts:
                torch.manual_seed(seed * 1000 + step * 10 + len(seqs))
                ids = torch.tensor([p] * n)
                gen = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAXT,
                                     pad_token_id=151643, eos_token_id=151645)
                for row in gen:
                    resp = row[len(p):].tolist()
                    if 151645 in resp:
                        resp = resp[:resp.index(151645) + 1]
                    seqs.append((p, resp))
                    rewards.append(R(tok.decode(resp, skip_special_tokens=True)))
        r = torch.tensor(rewards).view(len(prompts), n)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        out.append(r.mean().item())
        if update and step in (steps - 1, steps // 2):
            for (pp, rr) in seqs[:2]:
                print("   sample", step, repr(tok.decode(rr, skip_special_tokens=True))[:300], flush=True)
        if update:
            model.train()
            opt.zero_grad()
            total_tokens = sum(len(s[1]) for s in seqs)
            L = max(len(p) + len(r) for p, r in seqs)
            ids = torch.full((len(seqs), L), 151643)
            mask = torch.zeros((len(seqs), L))
            for i, (p, r) in enumerate(seqs):
                ids[i, :len(p) + len(r)] = torch.tensor(p + r)
                mask[i, len(p):len(p) + len(r)] = 1
            logits = model(ids).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(2, ids[:, 1:, None])[..., 0]
            loss = -(adv[:, None] * lp * mask[:, 1:]).sum() / total_tokens
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return out

t = time.time()
control = run(False)
trained = run(True)
print(reward_name, "lr", lr, "tied", tied, "n", n, "tasks", tasks, f"{time.time()-t:.0f}s")
print(" control", " ".join(f"{x:.3f}" for x in control))
print(" run    ", " ".join(f"{x:.3f}" for x in trained))
print(" reproduce: .ci/python-torch bench/learnability.py", " ".join(sys.argv[1:]))
print(" last3 margin", f"{sum(trained[-3:])/3 - sum(control[-3:])/3:+.3f}")
