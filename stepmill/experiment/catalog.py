"""What a cell's factors name: a dataset (bundled prompts, the reward that scores them), a method
(stepmill.train.methods) and a runtime (the [[agent]] that answers the prompts).

Runtimes: ``white-box`` (reply_once: token ids through the engine door, each token's version from the
engine), ``black-box`` (the openai-SDK tool loop through the proxy), or the name of any agent CLI recipe
in stepmill/data/agent-recipes.toml (``aider``: an unmodified CLI through the proxy), its program found
on PATH or in the project's .agents/ (.ci/install-agents).
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from stepmill.errors import ConfigError


@dataclass(frozen=True)
class Dataset:
    file: str  # in stepmill/data
    reward: str  # module:function
    says: str  # what it asks, for the report


DATASETS = {
    "animals16": Dataset("animals16.jsonl", "stepmill.rewards.functions:topic_words",
                         "sixteen different animals (words of the animals list)"),
    "notanimals16": Dataset("notanimals16.jsonl", "stepmill.rewards.functions:words_off_topic",
                            "sixteen different English words that are not animals"),
    "words8": Dataset("words8.jsonl", "stepmill.rewards.functions:words_exactly",
                      "exactly eight different English words"),
    "words16": Dataset("words16.jsonl", "stepmill.rewards.functions:letters_diverse",
                       "sixteen different English words on a named theme (the theme is not scored)"),
}

# What one call may add, every runtime alike: the engine's default (the tool loop names no cap), the
# white-box reply's cap (reply_once's max_tokens) and an agent CLI's {max_new_tokens} ([run] max_new_tokens).
CALL_TOKENS = 48
BUILT_IN_RUNTIMES = {
    "white-box": 'name = "white-box"\nentry = "stepmill.agents.reply_once:run"',
    "black-box": 'name = "black-box"\ncommand = ["{python}", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]\n'
                 'env = { OPENAI_API_KEY = "sk-local" }',
}
PROJECT = Path(__file__).resolve().parents[2]


def tasks_text(dataset: str, count: int) -> str:
    """The first ``count`` prompts of a bundled dataset, as JSONL."""
    lines = (resources.files("stepmill") / "data" / DATASETS[dataset].file).read_text().splitlines(True)
    return "".join(lines[:count])


def _recipes() -> dict[str, str]:
    """Each shipped recipe's [[agent]] table as written (comments kept), by name."""
    text = (resources.files("stepmill") / "data" / "agent-recipes.toml").read_text()
    tables = {}
    for block in text.split("[[agent]]")[1:]:
        found = re.search(r'^name = "([^"]+)"', block, re.M)
        if found:
            tables[found.group(1)] = block.split("\n", 1)[1].strip()
    return tables


def _program(name: str) -> str | None:
    """Where an agent CLI is: on PATH, else where .ci/install-agents puts it in the project."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (PROJECT / ".agents" / "node_modules" / ".bin" / name, *PROJECT.glob(f".agents/*/bin/{name}")):
        if candidate.exists():
            return str(candidate)
    return None


def agent_table(runtime: str) -> str:
    """The [[agent]] table (without its header) of a runtime, its program given by full path (a sandboxed
    run sees the program's install folder, not the runner's PATH)."""
    if runtime in BUILT_IN_RUNTIMES:
        return BUILT_IN_RUNTIMES[runtime]
    table = _recipes()[runtime]
    command = tomllib.loads(table)["command"]
    # a recipe that starts its CLI through a shell line names it as the shell's $0
    program = command[3] if command[0] in ("sh", "bash") and command[1] == "-c" else command[0]
    path = _program(program)
    if path is None:
        raise ConfigError(f"runtime {runtime!r}: its program {program!r} is not installed (on PATH or by "
                          ".ci/install-agents)")
    at = table.index("command = [")
    return table[:at] + table[at:].replace(f'"{program}"', json.dumps(path), 1)


def check_factor(factor: str, value: str) -> None:
    """ConfigError unless ``value`` names a known dataset, method or runtime."""
    from stepmill.train.config import METHODS

    known = {"dataset": list(DATASETS), "method": list(METHODS),
             "runtime": [*BUILT_IN_RUNTIMES, *_recipes()]}[factor]
    if value not in known:
        raise ConfigError(f"{factor} {value!r}: one of {', '.join(known)}")
