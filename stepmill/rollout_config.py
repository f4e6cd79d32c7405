"""The rollout configuration: agents, datasets, the run, the proxy, rewards — one TOML file.

    [proxy]                                   # reuse a running proxy, or leave out to start one
    url = "http://127.0.0.1:8080"

    [[agent]]
    name = "tool-loop"
    command = ["python", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]
    input = "stdin"                           # stdin | argument ({task} in command) | file (task.txt)
    env = { OPENAI_API_KEY = "sk-local" }

    [[dataset]]
    name = "arith"
    path = "tasks.jsonl"                      # one task a line: {"id", "prompt", "answer", …}

    [run]
    agent = "tool-loop"
    dataset = "arith"
    n = 4                                     # rollouts per task: one GRPO group
    concurrency = 4
    timeout = 120                             # seconds per run
    channel = "train"
    model = "qwen"

    [[reward]]                                # as in `stepmill score`
    name = "math"
    function = "stepmill.store.reward_functions:math_answer"

Unknown keys and bad values are errors that name the key and its line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    pass


@dataclass
class Agent:
    name: str
    command: list
    input: str = "stdin"
    env: dict = field(default_factory=dict)
    file: str = "task.txt"


@dataclass
class Run:
    agent: str
    dataset: str
    n: int = 4
    concurrency: int = 4
    timeout: float = 300.0
    channel: str = "train"
    model: str = "default"
    policy_version: str | None = None


@dataclass
class Config:
    path: Path
    agents: dict
    datasets: dict  # name -> path
    run: Run
    proxy: dict
    rewards: bool  # whether the file has [[reward]] tables

    def tasks(self, dataset: str) -> list[dict]:
        import json

        path = self.datasets[dataset]
        tasks = []
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(task, dict) or "prompt" not in task:
                raise ConfigError(f"{path}:{number}: a task is an object with a 'prompt'")
            task.setdefault("id", str(number))
            tasks.append(task)
        return tasks


SECTIONS = {"proxy": {"url", "db", "confdir", "args"}, "agent": {"name", "command", "input", "env", "file"},
            "dataset": {"name", "path"}, "run": set(Run.__dataclass_fields__), "reward": None}


def _line_of(text: str, section: str, key: str | None) -> int:
    """The line of ``key`` in the (first matching) ``[section]`` / ``[[section]]``, or of the section."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"^\s*\[\[?{re.escape(section)}\]\]?\s*$", line)), None)
    if start is None:
        return 1
    if key is None:
        return start + 1
    for i in range(start + 1, len(lines)):
        if re.match(r"^\s*\[", lines[i]):
            break
        if re.match(rf"^\s*{re.escape(key)}\s*=", lines[i]):
            return i + 1
    return start + 1


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None

    def fail(section, key, message):
        raise ConfigError(f"{path}:{_line_of(text, section, key)}: {section}{'.' + key if key else ''}: {message}")

    for name in data:
        if name not in SECTIONS:
            fail(name, None, f"unknown section; expected some of {', '.join(sorted(SECTIONS))}")
    for section, keys in SECTIONS.items():
        entries = data.get(section, [])
        for entry in entries if isinstance(entries, list) else [entries]:
            for key in entry if keys is not None else []:
                if key not in keys:
                    fail(section, key, f"unknown key; expected some of {', '.join(sorted(keys))}")
    agents = {}
    for entry in data.get("agent", []):
        command = entry.get("command")
        if not isinstance(entry.get("name"), str):
            fail("agent", "name", "a string is required")
        if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
            fail("agent", "command", "a non-empty list of strings is required")
        if entry.get("input", "stdin") not in ("stdin", "argument", "file"):
            fail("agent", "input", "must be stdin, argument or file")
        if not isinstance(entry.get("env", {}), dict):
            fail("agent", "env", "must be a table")
        agents[entry["name"]] = Agent(**entry)
    datasets = {}
    for entry in data.get("dataset", []):
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            fail("dataset", None, "name and path (strings) are required")
        datasets[entry["name"]] = str((path.parent / entry["path"]).resolve())
    run = data.get("run")
    if not isinstance(run, dict):
        fail("run", None, "a [run] table is required")
    for key in ("agent", "dataset"):
        if key not in run:
            fail("run", None, f"{key!r} is required")
    if run["agent"] not in agents:
        fail("run", "agent", f"no [[agent]] named {run['agent']!r}")
    if run["dataset"] not in datasets:
        fail("run", "dataset", f"no [[dataset]] named {run['dataset']!r}")
    for key in ("n", "concurrency"):
        if key in run and not (isinstance(run[key], int) and run[key] > 0):
            fail("run", key, "a positive integer is required")
    if "timeout" in run and not (isinstance(run["timeout"], (int, float)) and run["timeout"] > 0):
        fail("run", "timeout", "a positive number of seconds is required")
    if "policy_version" in run:
        run["policy_version"] = str(run["policy_version"])
    return Config(path, agents, datasets, Run(**run), data.get("proxy", {}), bool(data.get("reward")))
