"""`stepmill score`: reward functions by configuration, run over completed trajectories.

    [[reward]]
    name = "math"                                                   # the reward rows' name
    function = "stepmill.rewards.functions:math_answer"        # module:function
    source = "rule"                                                 # rule | model | env | human | api
    where = { channel = "train", "metadata.dataset" = "gsm8k" }     # which trajectories (all if absent)
    options = { answer_key = "answer" }                             # keyword arguments of the function

A function gets the trajectory — ``id``, ``group_id``, ``channel``, ``metadata``, ``messages`` (the
last step's whole conversation), ``completion`` (its final answer), ``steps`` — and returns a score,
(score, details) or {"score": …, "details": …}. Each completed trajectory is scored once per
reward name; a function that raises is recorded (a reward row without a value, the error in its
details) and the run goes on; it is tried again next run.
"""

from __future__ import annotations

import importlib
import math
import tomllib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from stepmill.errors import ConfigError
from stepmill.store import curation
from stepmill.store import Store

SPEC_KEYS = {"name", "function", "source", "where", "options"}


@dataclass
class RewardSpec:
    name: str
    function: Callable
    source: str = "rule"
    where: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)


def load_config(path: str | Path) -> list[RewardSpec]:
    """The [[reward]] tables of a rewards file (nothing else in it)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return reward_specs(data, path)


def reward_specs(data: dict, path: str | Path, *, other_sections: bool = False) -> list[RewardSpec]:
    """The [[reward]] tables of a file as parsed (``other_sections``: a rollout configuration's, which has
    more: ``Config.tables``)."""
    unknown = set(data) - {"reward"}
    if unknown and not other_sections:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}; rewards go in [[reward]] tables")
    specs = []
    for i, entry in enumerate(data.get("reward") or []):
        where = f"{path}: [[reward]] #{i + 1}"
        extra = set(entry) - SPEC_KEYS
        if extra:
            raise ConfigError(f"{where}: unknown key {sorted(extra)[0]!r}; expected some of {', '.join(sorted(SPEC_KEYS))}")
        for key in ("name", "function"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ConfigError(f"{where}: {key!r} is required (a string)")
        if entry.get("source", "rule") not in curation.SOURCES:
            raise ConfigError(f"{where}: 'source' must be one of {', '.join(curation.SOURCES)}")
        module_name, _, attribute = entry["function"].partition(":")
        try:
            function = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"{where}: function {entry['function']!r} cannot be loaded ({exc})") from None
        for key in ("where", "options"):
            if not isinstance(entry.get(key, {}), dict):
                raise ConfigError(f"{where}: {key!r} must be a table")
        specs.append(RewardSpec(entry["name"], function, entry.get("source", "rule"), entry.get("where", {}),
                                entry.get("options", {})))
    if not specs:
        raise ConfigError(f"{path}: no [[reward]] tables")
    return specs


def _matches(trajectory: dict, where: dict) -> bool:
    for key, wanted in where.items():
        value: Any = trajectory
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value != wanted:
            return False
    return True


def trajectory_input(store: Store, row: dict) -> dict:
    """What a reward function receives."""
    steps = list(store.iter_steps(trajectory_id=row["id"], with_tokens=False))
    attempt = store.registered_at(row["id"])
    if attempt is not None:  # a resumed run is scored on its latest attempt alone
        steps = [s for s in steps if (s.get("started_at") or "") >= attempt]
    if row.get("completed_at"):  # a call that started after the run was completed is no part of it
        steps = [s for s in steps if (s.get("started_at") or "") <= row["completed_at"]]
    steps.sort(key=lambda s: (s["step_index"] is None, s["step_index"]))
    last = steps[-1] if steps else {}
    return {"id": row["id"], "group_id": row["group_id"], "channel": row["channel"],
            # the task's scoring-only fields (answers, tests) join the metadata here, and only here
            "metadata": {**(row["metadata"] or {}), **store.scoring_fields(row["id"])},
            "messages": (last.get("messages") or []) + ([last["completion"]] if last.get("completion") else []),
            "completion": last.get("completion"), "steps": steps}


@dataclass
class ScoreReport:
    scored: int = 0
    failed: int = 0
    skipped: int = 0


def score(store: Store, specs: list[RewardSpec], *, where: str | None = None, params: Any = (),
          id_prefix: str | None = None, group_id: str | None = None, batch_size: int = 32,
          progress: bool | None = None) -> dict[str, ScoreReport]:
    """Score completed trajectories without a value from each reward yet; one transaction per batch.
    ``where``: a condition on the trajectories (alias t) given by the user; ``id_prefix``: one rollout's;
    ``group_id``: one group's."""
    rows = store.completed_trajectories(where, params, id_prefix=id_prefix, group_id=group_id)
    reports = {}
    for spec in specs:
        report = reports[spec.name] = ScoreReport()
        done = store.rewarded_trajectories(spec.name)
        todo = [row for row in rows if row["id"] not in done]
        bar = tqdm(total=len(todo), desc=spec.name, unit="trajectory",
                   disable=(not progress) if progress is not None else None)
        for start in range(0, len(todo), batch_size):
            results = []
            for row in todo[start:start + batch_size]:
                trajectory = trajectory_input(store, row)
                if not _matches(trajectory, spec.where):
                    report.skipped += 1
                    continue
                results.append((row["id"], *_run(spec, trajectory)))
            store.add_trajectory_rewards(results, source=spec.source, name=spec.name)
            for _, value, _ in results:
                if value is None:
                    report.failed += 1
                else:
                    report.scored += 1
            bar.update(min(batch_size, len(todo) - start))
        bar.close()
    return reports


def _run(spec: RewardSpec, trajectory: dict) -> tuple[float | None, dict | None]:
    """(value, details); a failure is (None, the error) and never stops the run."""
    try:
        result = spec.function(trajectory, **spec.options)
        details = None
        if isinstance(result, dict):
            result, details = result.get("score"), result.get("details")
        elif isinstance(result, tuple):
            result, details = result
        value = float(result)
        if not math.isfinite(value):
            raise ValueError(f"the score is {value}")
        return value, details
    except Exception as exc:
        return None, {"error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=3)[-2000:]}
