"""A training run's checkpoint per policy version, next to its store: the weights (with ``[train.lora]``, the
adapter's alone: the base stays frozen and is read from ``[train] model`` again), the optimizer, the
random generators, the version the weights are served as, the groups the step that made them was
taken on, and the metrics of that step; ``stepmill train --resume`` continues from the latest.

Written before the groups are acknowledged: a trainer killed after the write finds those groups still
leased to its name on resume and acknowledges them without training on them again (their step is in
the checkpoint); killed before it, the groups come back unacknowledged and are trained on then. Either
way every group is trained on once. A checkpoint is written to a temporary file and renamed into place,
so a kill never leaves half of one; the two newest are kept.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np

KEEP = 2
FILE = "v{version:06d}.pt"


def checkpoint_folder(db: str, run: str) -> Path:
    """Where ``run``'s checkpoints live: ``<db>.checkpoints/<run>/`` beside the store."""
    return Path(f"{db}.checkpoints") / run


def save(folder: Path, *, version: int, model, optimizer, groups: list[str], metrics: dict, resumes: int,
         done: bool = False) -> Path:
    """The state after the step that made ``version``'s weights (on ``groups``), atomically."""
    import torch  # here only: stepmill.train.loop imports this module, and its callers need no torch

    from stepmill.train.engine_sync import is_peft
    from stepmill.train.policy import trained_state

    folder.mkdir(parents=True, exist_ok=True)
    state = {"version": version, "groups": list(groups), "metrics": dict(metrics), "resumes": resumes, "done": done,
             "model": trained_state(model, copy=False), "lora": is_peft(model),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    path = folder / FILE.format(version=version)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)
    for old in sorted(folder.glob("v*.pt"))[:-KEEP]:
        old.unlink()
    return path


def latest(folder: Path) -> dict | None:
    """The newest checkpoint's state, or None when the run has none (it then starts from the beginning)."""
    import torch  # here only: stepmill.train.loop imports this module, and its callers need no torch

    paths = sorted(folder.glob("v*.pt")) if folder.is_dir() else []
    if not paths:
        return None
    # the trainer's own file, beside its store: it holds numpy's generator state, which weights_only refuses
    return torch.load(paths[-1], map_location="cpu", weights_only=False)


def restore(state: dict, model, optimizer) -> None:
    """Weights, optimizer and random generators as they were when ``state`` was saved."""
    import torch  # here only: stepmill.train.loop imports this module, and its callers need no torch

    from stepmill.errors import ConfigError
    from stepmill.train.engine_sync import is_peft
    from stepmill.train.policy import load_trained_state

    if state.get("lora", False) != is_peft(model):
        saved, now = ("a LoRA adapter", "the full weights") if state.get("lora") else ("the full weights", "a LoRA adapter")
        raise ConfigError(f"the checkpoint holds {saved}, and [train] now trains {now}: resume with the [train] "
                          "table the run started with, or start a new run")
    load_trained_state(model, state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


class Resume:
    """One run's checkpoints: on ``resume`` the latest is restored into ``policy`` and what it says
    is kept (``version``: where the run goes on from; ``groups`` and ``metrics``: its step's; ``done``:
    the run had finished); ``rounds``: the name the run's rollout rounds go under, a new one for each
    resume (a killed round's half-made trajectories keep theirs)."""

    def __init__(self, db: str, run: str, policy, *, resume: bool):
        self.folder, self.policy = checkpoint_folder(db, run), policy
        state = latest(self.folder) if resume else None
        self.version, self.resumes, self.groups, self.metrics, self.done = 0, 0, [], {}, False
        if state is not None:
            restore(state, policy.model, policy.optimizer)
            policy.version = state["version"]
            self.version, self.groups, self.metrics = state["version"], state["groups"], state["metrics"]
            self.resumes, self.done = state["resumes"] + 1, state["done"]
        elif self.folder.is_dir():  # a fresh start of a run that had checkpoints: none of them is its
            for old in self.folder.glob("v*.pt"):
                old.unlink()
        self.rounds = run if not self.resumes else f"{run}-resume{self.resumes}"

    def save(self, version: int, batches: list, metrics: dict) -> None:
        save(self.folder, version=version, model=self.policy.model, optimizer=self.policy.optimizer,
             groups=[b.meta["group_id"] for b in batches], metrics=metrics, resumes=self.resumes)

    def finish(self, version: int) -> None:
        """The run ended at ``version``: a resume reads it back instead of training again."""
        save(self.folder, version=version, model=self.policy.model, optimizer=self.policy.optimizer, groups=[],
             metrics={}, resumes=self.resumes, done=True)
