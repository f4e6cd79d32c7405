"""The policy being trained: its weights (the engine's starting folder), its optimizer, its RL method,
and one optimizer step over whole groups in the configured layout."""

from __future__ import annotations

import copy
import math

import torch

from stepmill.trainer_bridge.layouts import step_rows, trajectory_batch

from stepmill.errors import ConfigError
from stepmill.train.config import LoraConfig, TrainConfig
from stepmill.train.engine_sync import LoraAdapter, is_peft
from stepmill.train.forward import AdapterOff, micro_batch_loss, sampled_logprobs
from stepmill.train.methods import method as rl_method
from stepmill.train.micro_batches import claimed_steps, layout_batch, row_chunks


def load_model(folder: str, seed: int, *, device: str = "cpu", dtype: str = "float32", attention: str = "eager",
               gradient_checkpointing: bool = False):
    """The weights the engine serves at the start, on ``device`` in ``dtype`` (the engine is served them
    as the trainer holds them), with the ``attention`` kernel (transformers' name) and, when asked,
    gradient checkpointing (each layer's activations recomputed in the backward)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation=attention)
    model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def policy_model(train: TrainConfig):
    """``load_model`` as the ``[train]`` table asks: its device, dtype, attention and checkpointing; with
    ``[train.lora]``, a peft model around it that trains only the adapter."""
    model = load_model(train.model, train.seed, device=train.torch_device(), dtype=train.torch_dtype(),
                       attention=train.attention_implementation(), gradient_checkpointing=train.gradient_checkpointing)
    return with_lora(model, train.lora) if train.lora else model


def with_lora(model, lora: LoraConfig):
    """``model`` wrapped by peft with a new LoRA adapter (B = 0: it starts as the base), its base weights
    frozen. No dropout: the trainer's logprobs must be the engine's, which applies none."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError, a ValueError: a module name the model lacks
        raise ConfigError(f"[train.lora] target_modules: {exc}") from None
    wrapped.train()
    return wrapped


def trained_state(model, *, copy: bool = True) -> dict:
    """What training changes: the adapter's weights (peft's names) for a LoRA policy, else every weight;
    ``copy``: cloned (a state dict shares the parameters' storage, which the next step changes)."""
    if is_peft(model):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()} if copy else state


def load_trained_state(model, state: dict) -> None:
    """``trained_state``'s weights put back into ``model``; a state of another kind is refused."""
    if is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        if result.unexpected_keys:
            raise ConfigError(f"the saved state is not this LoRA policy's: {sorted(result.unexpected_keys)[:3]} …")
        return
    model.load_state_dict(state)


class Policy:
    def __init__(self, train: TrainConfig):
        self.train = train
        self.model = policy_model(train)
        options = {"clip_low": train.clip_low, "clip_high": train.clip_high, "kl_coef": train.kl,
                   "norm_length": train.norm_length}  # the constant of "sum_norm" aggregation (Dr. GRPO's)
        if train.aggregation:
            options["aggregation"] = train.aggregation
        self.method = rl_method(train.method, **options)
        self.version = 0  # the version the engine serves these weights as (``serving``)
        self.snapshots: dict[int, dict | None] = {}
        self.reference = None
        if train.kl and is_peft(self.model):  # the starting weights: the frozen base under the adapter
            self.reference = AdapterOff(self.model)
        elif train.kl:  # the starting weights, frozen
            self.reference = copy.deepcopy(self.model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]  # the adapter alone with LoRA
        self.optimizer = torch.optim.AdamW(self.trained, lr=train.lr, weight_decay=0.0)

    def step(self, batches: list, *, update: bool) -> dict:
        """``epochs`` optimizer steps on the groups, the engine's logprobs the behaviour policy throughout
        (the first step is on-policy, later ones are held in by the clipping); ``update=False``, the
        control: the same forward, no step. The stats are the first step's, with the last one's loss
        and clip fraction beside them.

        Before the first step the model's weights are those the engine served for on-policy groups, so
        the gap between the trainer's and the engine's logprobs on the sampled tokens is measured here.
        Steps without a reward are left out of the step, counted in ``unrewarded_steps``."""
        steps = claimed_steps(batches)  # the claimed groups' token rows, read once
        batch = layout_batch(steps, self.train.layout, self.train.micro_batch_tokens)
        stats = {**self.sample_gap(steps), "unrewarded_steps": batch.unrewarded}
        if not len(batch):  # no step had a reward: nothing to learn from
            return stats
        plan = batch.plan  # every trained token, its trajectory and reward
        for epoch in range(self.train.epochs if update else 1):
            self.optimizer.zero_grad(set_to_none=True)
            step_stats = micro_batch_loss(self.model, batch.chunks, batch.layout, plan, self.method,
                                          reference=self.reference, backward=update)
            step_stats = {k: float(v) for k, v in step_stats.items() if isinstance(v, (int, float))}
            if epoch == 0:
                stats.update(step_stats)
            else:
                stats.update(last_loss=step_stats["loss"], last_clip_fraction=step_stats["clip_fraction"])
            if update:
                norm = float(torch.nn.utils.clip_grad_norm_(self.trained, 1.0))
                if not math.isfinite(norm):  # a step on it would write NaN weights to the engine
                    stats["skipped_steps"] = stats.get("skipped_steps", 0) + 1
                    continue
                stats.setdefault("grad_norm", norm)
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def adapter(self):
        """The LoRA adapter being trained (``LoraAdapter``), or None when the full weights are."""
        return LoraAdapter.from_peft(self.model) if self.train.lora else None

    def serving(self, version: int) -> None:
        """The engine now serves these weights as ``version``: kept (async) for as long as groups
        stamped with it may still be trained on, so their engine logprobs can be checked against them."""
        self.version = version
        keep = self.train.max_staleness if self.train.mode == "async" else 0
        self.snapshots[version] = trained_state(self.model) if keep else None
        for old in [v for v in self.snapshots if v < version - keep]:
            del self.snapshots[old]

    def sample_gap(self, steps: dict[str, list]) -> dict:
        """Engine vs trainer on the tokens the engine sampled (``steps``: ``claimed_steps``), each step under
        the weights of the version it is stamped with (``rollout_gap``: the largest difference), in
        micro-batches as training takes them. A step stamped with a version whose weights are no longer kept
        is counted in ``rollout_gap_unchecked``."""
        rows = step_rows(steps)
        if not rows:
            return {}
        stamps = [str(s.policy_version) for trajectory in steps.values() for s in trajectory]  # step_rows' order
        current = None  # a copy of the weights being trained, taken only when an older version's are loaded
        gaps, unchecked = [], 0
        with torch.no_grad():
            for version in sorted(set(stamps)):
                stamped = [row for row, v in zip(rows, stamps) if v == version]
                weights = self.snapshots.get(int(version)) if version.lstrip("-").isdigit() else None
                if version != str(self.version) and weights is None:
                    unchecked += len(stamped)
                    continue
                older = weights is not None and version != str(self.version)
                if older:  # the weights being trained, copied to come back to
                    current = current or trained_state(self.model)
                    load_trained_state(self.model, weights)
                try:
                    for part in row_chunks(stamped, self.train.micro_batch_tokens):
                        trainer, engine = sampled_logprobs(self.model, trajectory_batch([stamped[i] for i in part]))
                        gaps.append((trainer.double() - engine.double()).abs())
                finally:
                    if older:
                        load_trained_state(self.model, current)
        diff = torch.cat(gaps) if gaps else torch.zeros(0)
        return {"rollout_gap": float(diff.max()) if diff.numel() else None,
                "rollout_gap_mean": float(diff.mean()) if diff.numel() else None,
                "rollout_gap_unchecked": unchecked}

