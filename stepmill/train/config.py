"""The ``[train]`` table of a rollout file: how ``stepmill train`` learns from the rollout's groups.

    [train]
    model = "engine/model"        # the weights the engine serves at the start (an HF folder), relative to the file
    method = "grpo"               # grpo | dr_grpo | rloo | reinforce_pp (stepmill.train.methods)
    layout = "steps"              # steps (padded) | rows (trajectory rows) | tree (prefix tree, FlexAttention)
    aggregation = "token"         # token | sequence (a trajectory's token mean, then their mean) | sum_norm
                                  # (the sum over norm_length tokens per trajectory); default: the method's own
    norm_length = 64              # dr_grpo: the constant length (the generation budget)
    mode = "sync"                 # sync: roll out, train, sync | async: rollouts never wait for training
    iterations = 10               # policy versions after the first
    epochs = 1                    # optimizer steps on each version's groups (PPO epochs; the clip holds later ones in)
    lr = 1e-3
    clip_low = 0.2                # PPO-style clipping of the ratio to the engine's (behaviour) logprobs
    clip_high = 0.28
    kl = 0.0                      # weight of a KL term to the starting weights (0: none, and no reference kept)
    max_staleness = 1             # async: groups older than this many versions are set aside, never trained on
    engine = "http://127.0.0.1:8000"   # the engine's admin origin (default: [route] base_url's origin)
    tolerance = 1e-4              # the probe's largest engine-vs-trainer logprob gap after a sync (default:
                                  # the dtype's, TOLERANCES)
    device = "auto"               # auto (CUDA when present, else the CPU) | cpu | cuda | cuda:N
    dtype = "auto"                # auto (bfloat16 on a GPU, float32 on the CPU) | bfloat16 | float32
    attention = "auto"            # auto (FlexAttention for the tree on CUDA, else SDPA) | sdpa | eager | flex
    gradient_checkpointing = false  # recompute each layer's activations in the backward (less memory)
    micro_batch_tokens = 0        # real tokens per forward/backward, gradients accumulated (0: the whole batch)
    control = true                # also run the paired control: same seeds and tasks, no optimizer step
    seed = 0
    val_every = 0                 # roll out the val dataset every k versions (0: never)
    val_dataset = "held-out"      # a [[dataset]] whose groups go to the val channel
    consumer = "local"            # local (the rollout's file) | http://node:port (stepmill serve) | postgresql://… (fleet)

    [train.lora]                  # train a LoRA adapter (peft), the base weights frozen; absent: the full weights
    rank = 8                      # the adapter's rank r (the engine's --max-lora-rank must be at least this)
    alpha = 16                    # its scale is alpha / rank
    target_modules = ["q_proj", "v_proj"]   # the names of the linear layers it adapts (the model's own)

Every key is optional but ``model``; command-line options of ``stepmill train`` win over the file. With
``[train.lora]`` each version is served as an adapter the engine loads in place (``VLLMSync.sync_lora``),
under the name ``LoraConfig.served_name`` gives, and the rollouts call that name as their model.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from stepmill.errors import ConfigError

METHODS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
LAYOUTS = ("steps", "rows", "tree")
AGGREGATIONS = ("token", "sequence", "sum_norm")
MODES = ("sync", "async")
DEVICES = ("auto", "cpu", "cuda")  # and cuda:N
DTYPES = ("auto", "bfloat16", "float32")
ATTENTIONS = ("auto", "sdpa", "eager", "flex")
# the probe's default tolerance per dtype: the largest engine-vs-trainer logprob gap a sync may show
TOLERANCES = {"float32": 1e-4, "bfloat16": 0.1}
LORA_KEYS = ("rank", "alpha", "target_modules")


@dataclass
class LoraConfig:
    """``[train.lora]``: a LoRA adapter of ``rank`` on ``target_modules``, scaled by ``alpha / rank``."""

    rank: int = 8
    alpha: float = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    def check(self, where: str) -> "LoraConfig":
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"{where}: rank must be a positive integer, not {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ConfigError(f"{where}: alpha must be a positive number, not {self.alpha!r}")
        modules = self.target_modules
        if isinstance(modules, str) or not isinstance(modules, (list, tuple)) or not modules or not all(
                isinstance(m, str) and m.isidentifier() for m in modules):
            raise ConfigError(f"{where}: target_modules must be a non-empty list of module names "
                              f"(\"q_proj\", \"v_proj\", …), not {modules!r}")
        self.target_modules = tuple(modules)
        return self

    @staticmethod
    def served_name(model: str, run: str) -> str:
        """The name the engine serves a run's adapter under: beside the base model's, never equal to it."""
        return f"{model}-{run}"


def lora_config(value, where: str) -> LoraConfig | None:
    """``[train] lora`` as read from a file (a table) or given in code (a LoraConfig, or None: no LoRA)."""
    if value is None or isinstance(value, LoraConfig):
        return value.check(where) if value is not None else None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table ([train.lora] rank = 8, alpha = 16, target_modules = "
                          f"[\"q_proj\", \"v_proj\"]), not {value!r}")
    unknown = sorted(set(value) - set(LORA_KEYS))
    if unknown:
        raise ConfigError(f"{where}: {', '.join(unknown)}: unknown key; expected some of {', '.join(LORA_KEYS)}")
    return LoraConfig(**value).check(where)


@dataclass
class TrainConfig:
    model: str | None = None
    method: str = "grpo"
    layout: str = "steps"
    aggregation: str | None = None
    norm_length: int = 64
    mode: str = "sync"
    iterations: int = 10
    epochs: int = 1
    lr: float = 1e-3
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl: float = 0.0
    max_staleness: int = 1
    engine: str | None = None
    tolerance: float | None = None
    control: bool = True
    seed: int = 0
    val_every: int = 0
    val_dataset: str | None = None
    consumer: str = "local"
    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = 0
    lora: LoraConfig | None = None

    def check(self, where: str = "[train]") -> "TrainConfig":
        choices = {"method": METHODS, "layout": LAYOUTS, "aggregation": AGGREGATIONS, "mode": MODES,
                   "dtype": DTYPES, "attention": ATTENTIONS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed and not (key == "aggregation" and self.aggregation is None):
                raise ConfigError(f"{where}: {key} must be one of {', '.join(allowed)}, not {getattr(self, key)!r}")
        if not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1:
            raise ConfigError(f"{where}: epochs must be a positive integer, not {self.epochs!r}")
        if not isinstance(self.device, str) or not (self.device in DEVICES or _cuda_index(self.device)):
            raise ConfigError(f"{where}: device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ConfigError(f"{where}: gradient_checkpointing must be true or false, not {self.gradient_checkpointing!r}")
        if self.attention == "flex" and self.layout != "tree":
            raise ConfigError(f"{where}: attention = \"flex\" is the tree layout's (its block mask); "
                              f"layout {self.layout!r} takes sdpa or eager")
        for key in ("iterations", "max_staleness", "val_every", "seed", "norm_length", "micro_batch_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: {key} must be a non-negative integer, not {value!r}")
        for key in ("lr", "clip_low", "clip_high", "kl", "tolerance"):
            value = getattr(self, key)
            if key == "tolerance" and value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: {key} must be a non-negative number, not {value!r}")
        if not self.model:
            raise ConfigError(f"{where}: model is required (the folder of the weights the engine serves at the start)")
        if self.val_every and not self.val_dataset:
            raise ConfigError(f"{where}: val_every needs val_dataset (a [[dataset]] name)")
        self.lora = lora_config(self.lora, f"{where} lora")
        return self

    def torch_device(self) -> str:
        """The device the trainer runs on: ``auto`` is CUDA when torch sees one."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"[train] device = {self.device!r}, but torch sees no CUDA device")
        return self.device

    def torch_dtype(self) -> str:
        """``bfloat16`` or ``float32``: ``auto`` is bfloat16 on a GPU, float32 on the CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.torch_device().startswith("cuda") else "float32"

    def attention_implementation(self) -> str:
        """The attention kernel the model is loaded with (transformers' name): ``auto`` is FlexAttention
        for the tree on CUDA (its block mask; torch has no FlexAttention backward on the CPU), else SDPA."""
        if self.attention == "flex" and not self.torch_device().startswith("cuda"):
            raise ConfigError("[train] attention = \"flex\" needs a CUDA device: torch has no FlexAttention "
                              "backward on the CPU")
        if self.attention == "auto":
            flex = self.layout == "tree" and self.torch_device().startswith("cuda")
            return "flex_attention" if flex else "sdpa"
        return {"flex": "flex_attention"}.get(self.attention, self.attention)

    def probe_tolerance(self) -> float:
        """The probe's tolerance: the file's, else the one of the dtype the weights are served in."""
        return self.tolerance if self.tolerance is not None else TOLERANCES[self.torch_dtype()]


def _cuda_index(device: str) -> bool:
    prefix, _, number = device.partition(":")
    return prefix == "cuda" and number.isdigit()


def load_train(source, **overrides) -> TrainConfig:
    """The ``[train]`` table of a rollout configuration already read (a runner ``Config``: the file is
    parsed once) or of a file, ``overrides`` (the command line; None means not given) on top, checked.
    A relative ``model`` is relative to the file."""
    if hasattr(source, "tables"):
        path, data = Path(source.path), source.tables.get("train", {})
    else:
        path = Path(source)
        try:
            data = tomllib.loads(path.read_text()).get("train", {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
    data = dict(data)  # the overrides and the resolved model go on a copy, never on the parsed file
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: [train] must be a table")
    known = {f.name for f in fields(TrainConfig)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{path}: [train] {key}: unknown key; expected some of {', '.join(sorted(known))}")
    if isinstance(data.get("model"), str) and not Path(data["model"]).is_absolute():
        data["model"] = str((path.parent / data["model"]).resolve())  # the file's is relative to the file
    data.update({k: v for k, v in overrides.items() if v is not None})  # the command line's, to where it ran
    config = TrainConfig(**data)
    if config.model:
        config.model = str(Path(config.model).resolve())
    return config.check(f"{path}: [train]")
