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
    tolerance = 1e-4              # the probe's largest engine-vs-trainer logprob gap after a sync
    control = true                # also run the paired control: same seeds and tasks, no optimizer step
    seed = 0
    val_every = 0                 # roll out the val dataset every k versions (0: never)
    val_dataset = "held-out"      # a [[dataset]] whose groups go to the val channel
    consumer = "local"            # local (the rollout's file) | http://node:port (stepmill serve) | postgresql://… (fleet)

Every key is optional but ``model``; command-line options of ``stepmill train`` win over the file.
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
    tolerance: float = 1e-4
    control: bool = True
    seed: int = 0
    val_every: int = 0
    val_dataset: str | None = None
    consumer: str = "local"

    def check(self, where: str = "[train]") -> "TrainConfig":
        choices = {"method": METHODS, "layout": LAYOUTS, "aggregation": AGGREGATIONS, "mode": MODES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed and not (key == "aggregation" and self.aggregation is None):
                raise ConfigError(f"{where}: {key} must be one of {', '.join(allowed)}, not {getattr(self, key)!r}")
        if not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1:
            raise ConfigError(f"{where}: epochs must be a positive integer, not {self.epochs!r}")
        for key in ("iterations", "max_staleness", "val_every", "seed", "norm_length"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: {key} must be a non-negative integer, not {value!r}")
        for key in ("lr", "clip_low", "clip_high", "kl", "tolerance"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: {key} must be a non-negative number, not {value!r}")
        if not self.model:
            raise ConfigError(f"{where}: model is required (the folder of the weights the engine serves at the start)")
        if self.val_every and not self.val_dataset:
            raise ConfigError(f"{where}: val_every needs val_dataset (a [[dataset]] name)")
        return self


def load_train(path: str | Path, **overrides) -> TrainConfig:
    """The file's ``[train]`` table, ``overrides`` (the command line; None means not given) on top,
    checked. A relative ``model`` is relative to the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text()).get("train", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
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
