"""One round of the closed loop as a rollout: the dataset's tasks under ids of the round's own, on the
run's channel, stamped with the version that serves them, seeded alike for a run and its paired control."""

from __future__ import annotations

import copy

from stepmill.runner.config import Config


def round_config(config: Config, run: str, number: int, *, channel: str, version: int | None,
                 dataset: str | None = None, seed: int | None = None, model: str | None = None) -> Config:
    """The rollout of one round: the dataset's tasks under ids of their own (``<run>-r<k>-<dataset>-…``),
    on ``channel``, stamped with ``version`` (None: whatever version is in force when each call starts),
    the agents calling ``model`` (a LoRA run's adapter; None: the rollout's own model)."""
    round_ = copy.copy(config)
    round_.run = copy.copy(config.run)
    source = dataset or config.run.dataset
    name = f"{run}-r{number}-{source}"
    round_.datasets = {**config.datasets, name: config.datasets[source]}
    round_.public = {**config.public, name: config.public.get(source, [])}
    round_.library_paths = {**config.library_paths, name: config.library_paths.get(source, [])}  # hidden from runs
    round_.run.dataset, round_.run.channel = name, channel
    round_.run.policy_version = None if version is None else str(version)
    round_.run.model = model or config.run.model
    # the same round of a run and of its paired control draws with the same seeds
    round_.run.seed = None if seed is None else seed * 1_000_003 + number
    return round_
