"""A rollout's files for tests that run `stepmill rollout` through the test session's proxy: its
dataset and its TOML, written as a user writes them."""

from __future__ import annotations

import json
from pathlib import Path


def write_rollout(folder: Path, proxy, *, dataset: str, command: list[str], tasks: list[dict], agent: str = "agent",
                  env: dict | None = None, isolation: str = "", run: str = "", more: str = "") -> Path:
    """A rollout of one agent (``command``) on ``tasks``; ``isolation`` and ``run``: more TOML lines of
    those tables (``run`` sets n and timeout unless the defaults, 1 and 90, will do), ``more``: more
    tables. The dataset is owner-only (user mode refuses one others may read)."""
    tasks_file = folder / "tasks.jsonl"
    tasks_file.touch(mode=0o600)
    tasks_file.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    run_lines = [line for line in run.splitlines() if line.strip()]
    defaults = [f"{key} = {value}" for key, value in (("n", 1), ("timeout", 90))
                if not any(line.split("=")[0].strip() == key for line in run_lines)]
    config = folder / "rollout.toml"
    config.write_text(f"""
[proxy]
url = "{proxy.url}"
db = "{proxy.db}"
confdir = "{proxy.confdir}"

[[agent]]
name = "{agent}"
command = {json.dumps(command)}
env = {{ {", ".join(f'{k} = {json.dumps(v)}' for k, v in (env or {}).items())} }}

[[dataset]]
name = "{dataset}"
path = "tasks.jsonl"

[isolation]
{isolation}

[run]
agent = "{agent}"
dataset = "{dataset}"
{chr(10).join(defaults)}
{run}
{more}
""")
    return config
