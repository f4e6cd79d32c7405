"""The experiments file: a default cell, the factors varied around it, the seeds and the run's size.

    seeds = [0, 1, 2]          # every cell runs once per seed, beside its paired control (same seed)
    iterations = 10            # policy versions trained per run
    tasks = 4                  # the first prompts of the cell's dataset
    n = 4                      # rollouts per prompt (a group)
    lr = 5e-3

    [default]                  # the cell every other one differs from in one factor
    dataset = "animals16"
    method = "grpo"
    runtime = "black-box"

    [vary]                     # each value other than the default's is a cell of its own
    method = ["dr_grpo", "rloo", "reinforce_pp"]
    dataset = ["notanimals16", "words8"]
    runtime = ["white-box", "aider"]

Not the full product: the default cell, then each factor's other values with the others at the default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from stepmill.errors import ConfigError

FACTORS = ("method", "dataset", "runtime")  # the order cells run in: methods first (they share the default's control)
# the run's size and optimizer, the same for every cell: name -> (type, default)
SETTINGS = {"iterations": (int, 10), "tasks": (int, 4), "n": (int, 4), "lr": (float, 5e-3),
            "concurrency": (int, 4), "timeout": (int, 120), "layout": (str, "steps")}
TOP_KEYS = {"name", "seeds", "default", "vary", *SETTINGS}


@dataclass(frozen=True)
class Cell:
    dataset: str
    method: str
    runtime: str

    @property
    def name(self) -> str:
        return f"{self.dataset}-{self.method}-{self.runtime}"

    @property
    def control_key(self) -> tuple[str, str]:
        """What a paired control depends on: a control takes no step, so cells that differ only in the
        method share it (for the same seed)."""
        return self.dataset, self.runtime


@dataclass
class Experiment:
    name: str
    seeds: list[int]
    default: Cell
    vary: dict[str, list[str]] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def cells(self) -> list[Cell]:
        """The default cell first, then each factor's other values in the order the file gives them."""
        cells = [self.default]
        for factor in FACTORS:
            for value in self.vary.get(factor, []):
                cell = Cell(**{**self.default.__dict__, factor: value})
                if cell not in cells:
                    cells.append(cell)
        return cells


def _seeds(value) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise ConfigError(f"seeds: a list of whole numbers, not {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"seeds: each seed once, not {value!r}")
    return value


def _settings(data: dict) -> dict:
    settings = {}
    for key, (kind, default) in SETTINGS.items():
        value = data.get(key, default)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is not str and value <= 0):
            raise ConfigError(f"{key}: a positive {kind.__name__}, not {value!r}")
        settings[key] = value
    return settings


def _factor_values(factor: str, values) -> list[str]:
    from stepmill.experiment.catalog import check_factor

    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"[vary] {factor}: a list of names, not {values!r}")
    for value in values:
        check_factor(factor, value)
    return values


def parse(data: dict, name: str) -> Experiment:
    """An Experiment from the file's tables; every name is checked (ConfigError naming the key)."""
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(TOP_KEYS))}")
    default = data.get("default", {})
    if set(default) != set(FACTORS):
        raise ConfigError(f"[default] names exactly {', '.join(FACTORS)}, not {', '.join(sorted(default)) or 'nothing'}")
    vary = data.get("vary", {})
    if set(vary) - set(FACTORS):
        raise ConfigError(f"[vary]: the factors are {', '.join(FACTORS)}, not {', '.join(sorted(set(vary) - set(FACTORS)))}")
    cell = Cell(**{factor: _factor_values(factor, [default[factor]])[0] for factor in FACTORS})
    return Experiment(name=str(data.get("name", name)), seeds=_seeds(data.get("seeds", [0, 1, 2])), default=cell,
                      vary={factor: _factor_values(factor, values) for factor, values in vary.items()},
                      settings=_settings(data))


def load(path: str | Path) -> Experiment:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return parse(data, path.stem)
