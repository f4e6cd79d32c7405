"""The trainer as it runs on a GPU, checked against the float32 CPU path on the same batch.

Where CUDA is present: the policy in bfloat16 with FlexAttention on the prefix tree (the tree's
``mask_mod`` as a block mask), loss and gradients of one GRPO step over the groups, compared with the
float32 CPU trainer on padded steps (SDPA), the same weights and the same groups. Without CUDA (as on
the machine this was written on) it runs its CPU half: bfloat16 on the CPU on the tree with a dense
mask against the same float32 reference, and says so.

The groups are ``bench.train_bench``'s (multi-turn rollouts sharing a system prompt, written to a
SQLite store and read back as a consumer hands them out); the model a random Qwen2 of that bench.
Printed: a table (loss, gap to the reference, the gradients' cosine and relative error, seconds) and
the command that reproduces it. It exits 1 when bf16's loss differs by more than 2e-2 or its gradient's
cosine to float32's is below 0.99.

    .venv/bin/python -m bench.gpu_check
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.train_bench import _with_torch, build_store, model_for

LOSS_GAP = 2e-2  # bf16's loss against float32's, on the same batch
GRAD_COSINE = 0.99


def step(model, batches: list, layout: str, attention: str) -> tuple[float, dict, float]:
    """One GRPO loss and its gradients (flattened per parameter, float32, on the CPU), and seconds."""
    import torch

    from stepmill.train.forward import micro_batch_loss
    from stepmill.train.methods import method
    from stepmill.train.micro_batches import claimed_steps, layout_batch

    batch = layout_batch(claimed_steps(batches), layout)
    plan = batch.plan
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    stats = micro_batch_loss(model, batch.chunks, batch.layout, plan, method("grpo"), attention=attention)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    grads = {n: p.grad.detach().float().cpu().reshape(-1) for n, p in model.named_parameters() if p.grad is not None}
    return stats["loss"], grads, seconds


def near_policy(batches: list, model) -> None:
    """The engine's logprobs made the reference model's own, nudged by up to 0.3 nats: ratios near 1,
    some clipped, as after a step (the bench's random logprobs would clip every token)."""
    import numpy as np
    import torch

    from stepmill.train.forward import sampled_logprobs

    rng = np.random.default_rng(1)
    for batch in batches:
        t = batch.tensors
        with torch.no_grad():
            logprobs = sampled_logprobs(model, batch)[0].numpy()
        prompt = t["prompts"].shape[1]
        rows, cols = np.nonzero(t["response_mask"].astype(bool) & (t["position_ids"][:, prompt:] > 0))
        t["rollout_log_probs"][rows, cols] = logprobs + rng.uniform(-0.3, 0.3, len(logprobs))


def compare(reference: dict, grads: dict) -> tuple[float, float]:
    """The cosine of all gradients together, and the largest per-parameter relative error."""
    import torch

    a = torch.cat([reference[n] for n in reference]).double()
    b = torch.cat([grads[n] for n in reference]).double()
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    relative = max(float((grads[n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in reference.items())
    return cosine, relative


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("groups", 2), ("n", 4), ("turns", 3), ("system", 256), ("task", 16), ("response", 32),
                          ("observation", 16), ("vocab", 4096), ("hidden", 128), ("layers", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    _with_torch()
    import torch

    from stepmill.store import Store
    from stepmill.trainer_bridge.layouts import step_batches

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        groups = build_store(Path(tmp) / "steps.db", args)
        store = Store(Path(tmp) / "steps.db")
        batches = [b for g in groups for b in step_batches(store, group_id=g, batch_size=1 << 20)]
        store.close()
    reference = model_for(args, "sdpa", torch.float32).to("cpu")
    near_policy(batches, reference)
    runs = {"float32, CPU, steps, SDPA (reference)": (reference, "steps", "auto")}
    if cuda:
        runs["bfloat16, CUDA, tree, FlexAttention"] = (model_for(args, "flex_attention", torch.bfloat16), "tree", "flex")
    else:
        runs["bfloat16, CPU, tree, dense mask (the CPU half)"] = (model_for(args, "sdpa", torch.bfloat16), "tree", "auto")
    results = {label: step(model, batches, layout, attention) for label, (model, layout, attention) in runs.items()}
    (ref_label, (ref_loss, ref_grads, _)), *others = results.items()
    print(f"{'run':50} {'loss':>10} {'loss gap':>10} {'grad cosine':>12} {'grad rel err':>13} {'seconds':>8}")
    print(f"{ref_label:50} {ref_loss:10.6f} {'':>10} {'':>12} {'':>13} {results[ref_label][2]:8.2f}")
    ok = True
    for label, (loss, grads, seconds) in others:
        cosine, relative = compare(ref_grads, grads)
        ok &= abs(loss - ref_loss) <= LOSS_GAP and cosine >= GRAD_COSINE
        print(f"{label:50} {loss:10.6f} {abs(loss - ref_loss):10.2e} {cosine:12.6f} {relative:13.2e} {seconds:8.2f}")
    if not cuda:
        print("no CUDA device: only the CPU half ran (bf16 on the CPU, dense tree mask); run it where a GPU is")
    print("command:", shlex.join([sys.executable, "-m", "bench.gpu_check", *(argv or sys.argv[1:])]))
    print("within bounds" if ok else f"OUT OF BOUNDS: loss gap > {LOSS_GAP} or gradient cosine < {GRAD_COSINE}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
