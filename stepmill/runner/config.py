"""The rollout configuration: agents, datasets, routes, the run, the proxy, rewards — one TOML file.

    [proxy]                                   # reuse a running proxy, or leave out to start one
    url = "http://127.0.0.1:8080"

    [route]
    base_url = "http://127.0.0.1:8000/v1"     # the LLM endpoint (a vLLM server, an API)
    engines = ["127.0.0.1:8000"]              # upstreams asked for exact token ids (default: probed)
    reverse = false                           # true: agents get a tagged reverse-proxy base URL
    tokenizer = "path/to/tokenizer"           # white-box agents (default: the bundled Qwen2 vocabulary)

    [[agent]]                                 # black-box: any command, through the proxy
    name = "tool-loop"
    command = ["{python}", "-m", "stepmill.agents.tool_loop", "--model", "{model}"]
    input = "stdin"                           # stdin | argument ({task} in command) | file (task.txt)
    env = { OPENAI_API_KEY = "sk-local" }

    [[agent]]                                 # white-box: token in, token out, exact ids submitted
    name = "token-loop"
    entry = "stepmill.agents.token_loop:run"

    [[dataset]]
    name = "arith"
    path = "tasks.jsonl"                      # one task a line: {"id", "prompt", "answer", …}
    public = ["difficulty"]                   # task fields shown with the trajectory; all others but
                                              # id and prompt are for scoring only (answers, tests)

    [[dataset]]                               # or made by a library (datasets.py): instead of path,
    name = "chain"
    source = "reasoning-gym:chain_sum"        # reasoning-gym:<task> | humaneval
    size = 64                                 # how many tasks
    seed = 7                                  # which ones
    options = { min_terms = 2 }               # the task's own settings (reasoning-gym)

    [isolation]                               # how runs are kept from the runner's files (stepmill/runner/isolation/)
    mode = "auto"                             # auto | sandbox | user | container | none
    expose = ["/srv/repo"]                    # sandbox: more it sees, read-only ({ path, writable = true })
    network = "own"                           # sandbox: own (its only way out is the proxy) | host
    allow_hosts = ["pypi.org"]                # sandbox: reachable through the proxy besides the LLM
    pass_env = ["CUDA_VISIBLE_DEVICES"]       # more of the runner's environment than PATH, HOME, LANG, TERM
    limits = { pids = 1024, memory_mb = 4096, log_kb = 1024 }  # per run (limits.py)

    [run]
    agent = "tool-loop"
    dataset = "arith"
    n = 4                                     # rollouts per task: one GRPO group
    concurrency = 4
    timeout = 120                             # seconds per run
    channel = "train"
    model = "qwen"
    # runs_dir = "runs"                       # the runs' folders: new, empty or stepmill's (default: <database>.runs)
    # keep_runs_days = 7                      # older run folders are removed as a rollout starts (0: kept)
    # max_new_tokens = 4096                   # what one call may add (fills {max_new_tokens}): with an agent's
                                              # prompt_tokens it must fit the engine's context, or the rollout is refused (context_fit.py)
    # executor = "ray"                        # run on a Ray cluster's nodes (stepmill/fleet/ray_rollout.py), with:
    # ray_address = "head:6379"              # the head's GCS address (ray://… needs ray[client]); default: ray.init()'s choice
    # runs_per_node = 8                       # default: concurrency
    # node_dir = "/var/lib/stepmill"          # each node's SQLite file, on its local disk (WAL needs one)
    # coordinator = "postgresql://…"          # default: $STEPMILL_COORDINATOR; none: no fleet registry
    # retries = 2                             # a run cut by its node's proxy dying runs again, at most this often
    # serve = "keep"                          # each node's file served on after the rollout, until its groups are
                                              # consumed (`stepmill fleet serve --stop` ends it); default "stop"

    [[reward]]                                # as in `stepmill score`
    name = "math"
    function = "stepmill.rewards.functions:math_answer"

Unknown keys and bad values are errors that name the key and its line.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from stepmill.errors import ConfigError
from stepmill.runner import datasets as sources
from stepmill.runner.isolation import MODES, Isolation


@dataclass
class Agent:
    name: str
    command: list | None = None  # a black-box agent's command template
    entry: str | None = None  # a white-box agent's "module:function"
    input: str = "stdin"
    env: dict = field(default_factory=dict)
    file: str = "task.txt"
    prompt_tokens: int | None = None  # the opening prompt's size (system prompt, tools): checked against the engine


@dataclass
class EngineRoute:
    """Where a run's LLM calls go: the engine(s) behind the proxy, and the tokenizer of a white-box run."""
    base_url: str | None = None
    engines: list = field(default_factory=list)
    reverse: bool = False
    tokenizer: str | None = None


@dataclass
class RolloutSettings:
    """The [run] table: which agents run on which dataset, how many times, how many at once, where."""
    agent: list  # one or more [[agent]] names
    dataset: str
    n: int = 4
    concurrency: int = 4
    timeout: float = 300.0
    channel: str = "train"
    model: str = "default"
    policy_version: str | None = None
    seed: int | None = None  # sampling: each run gets {seed} (and STEPMILL_SEED) from this, its task and sample
    executor: str = "local"  # local | ray
    ray_address: str | None = None  # the Ray cluster (None: ray.init()'s own choice, a running one or a new local one)
    runs_per_node: int | None = None  # Ray: concurrent runs on each node (default: concurrency)
    node_dir: str = "~/.stepmill/nodes"  # Ray: each node's files, on that node's local disk
    coordinator: str | None = None  # Ray: the fleet's PostgreSQL (default: $STEPMILL_COORDINATOR)
    retries: int = 2  # Ray: how often a run cut by its node's proxy dying (or its task lost) runs again
    serve: str = "stop"  # Ray: each node's serve stops with the rollout, or is kept until its groups are consumed
    runs_dir: str | None = None  # the runs' folders: new, empty or stepmill's (default: <database>.runs)
    keep_runs_days: float = 7  # stepmill's run folders older than this go when a rollout or Ray node starts; 0: kept
    max_new_tokens: int | None = None  # what one call may add to its prompt (context_fit.py)


EXECUTORS = ("local", "ray")
SERVE_AFTER = ("stop", "keep")


@dataclass
class Config:
    path: Path
    agents: dict
    datasets: dict  # name -> path
    run: RolloutSettings
    proxy: dict
    rewards: bool  # whether the file has [[reward]] tables
    route: EngineRoute = field(default_factory=EngineRoute)
    public: dict = field(default_factory=dict)  # dataset name -> task fields shown with trajectories
    isolation: Isolation = field(default_factory=Isolation)
    # dataset name -> folders of the library that made it (its data, or code that makes every answer
    # again): no run needs them, and a run that reads them has the answers
    library_paths: dict = field(default_factory=dict)
    # the file as parsed, once: [train] and [[reward]] are read from here (``load_train``, ``reward_specs``)
    tables: dict = field(default_factory=dict)

    def tasks(self, dataset: str) -> list[dict]:
        """The dataset's tasks, each with an ``id`` and a ``prompt`` (JSONL, or Parquet with pyarrow)."""
        import json

        path = self.datasets[dataset]
        if path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ConfigError(f"{path}: reading Parquet datasets needs pyarrow (pip install 'stepmill[arrow]')") from None
            rows = list(enumerate(pq.read_table(path).to_pylist(), start=1))
        else:
            rows = []
            for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except ValueError as exc:
                    raise ConfigError(f"{path}:{number}: not JSON ({exc})") from None
        tasks = []
        for number, task in rows:
            if not isinstance(task, dict) or not isinstance(task.get("prompt"), str):
                raise ConfigError(f"{path}:{number}: a task is an object with a 'prompt' string")
            task["id"] = str(task.get("id", number))
            tasks.append(task)
        return tasks


SECTIONS = {"proxy": {"url", "db", "confdir", "args"}, "agent": set(Agent.__dataclass_fields__),
            "dataset": {"name", "path", "public", *sources.SOURCE_KEYS}, "route": set(EngineRoute.__dataclass_fields__),
            "isolation": set(Isolation.__dataclass_fields__),
            "run": set(RolloutSettings.__dataclass_fields__), "reward": None,
            "train": None}  # [train]: read by stepmill.train.config


def _line_of(text: str, section: str, key: str | None, index: int = 0) -> int:
    """The line of ``key`` in the ``index``-th ``[section]`` / ``[[section]]``, or of the section."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(rf"^\s*\[\[?{re.escape(section)}\]\]?\s*$", line)]
    start = starts[min(index, len(starts) - 1)] if starts else None
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


BUNDLED = "stepmill:"


def dataset_path(value: str, base: Path) -> str:
    """A dataset file, relative to the configuration; ``stepmill:arith20`` is a bundled one."""
    if value.startswith(BUNDLED):
        from importlib import resources

        bundled = resources.files("stepmill") / "data" / f"{value[len(BUNDLED):]}.jsonl"
        if not bundled.is_file():
            names = sorted(f"{BUNDLED}{p.name[:-6]}" for p in (resources.files("stepmill") / "data").iterdir()
                           if p.name.endswith(".jsonl"))
            raise ConfigError(f"{value}: no bundled dataset of that name (there are {', '.join(names)})")
        return str(bundled)
    return str((base / os.path.expanduser(value)).resolve())


def _check_executor(run: dict, data: dict, fail) -> None:
    """The Ray executor's keys: only with executor = "ray", and each of the right kind."""
    executor = run.get("executor", "local")
    if executor not in EXECUTORS:
        fail("run", "executor", f"must be one of {', '.join(EXECUTORS)}")
    ray_keys = ("ray_address", "runs_per_node", "node_dir", "coordinator", "retries", "serve")
    if executor != "ray":
        for key in ray_keys:
            if key in run:
                fail("run", key, 'applies to executor = "ray" only')
        return
    for key in ("ray_address", "node_dir"):
        if key in run and not (isinstance(run[key], str) and run[key]):
            fail("run", key, "a non-empty string is required")
    if "runs_per_node" in run and not (isinstance(run["runs_per_node"], int) and not isinstance(run["runs_per_node"], bool)
                                       and run["runs_per_node"] > 0):
        fail("run", "runs_per_node", "a positive integer is required")
    if "retries" in run and not (isinstance(run["retries"], int) and not isinstance(run["retries"], bool)
                                 and run["retries"] >= 0):
        fail("run", "retries", "a whole number, 0 or more, is required")
    if run.get("serve", "stop") not in SERVE_AFTER:
        fail("run", "serve", f"must be one of {', '.join(SERVE_AFTER)}")
    if "coordinator" in run and not (isinstance(run["coordinator"], str)
                                     and re.match(r"postgres(ql)?://", run["coordinator"])):
        fail("run", "coordinator", "a postgresql:// URL is required")
    proxy = data.get("proxy") if isinstance(data.get("proxy"), dict) else {}
    for key in ("url", "db"):
        if key in proxy:
            fail("proxy", key, 'executor = "ray" starts a proxy on each node, with its own file in run.node_dir')


def _check_run_folders(run: dict, path: Path, fail) -> None:
    """Where the runs' folders go (relative to the configuration) and how long they are kept."""
    if "runs_dir" in run:
        if not (isinstance(run["runs_dir"], str) and run["runs_dir"]):
            fail("run", "runs_dir", "a folder path is required")
        run["runs_dir"] = str((path.parent / os.path.expanduser(run["runs_dir"])).resolve())
    days = run.get("keep_runs_days", 0)
    if isinstance(days, bool) or not isinstance(days, (int, float)) or days < 0:
        fail("run", "keep_runs_days", "a number of days ≥ 0 is required (0: never removed)")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None

    def fail(section, key, message, index=0):
        raise ConfigError(f"{path}:{_line_of(text, section, key, index)}: {section}{'.' + key if key else ''}: {message}")

    for name in data:
        if name not in SECTIONS:
            fail(name, None, f"unknown section; expected some of {', '.join(sorted(SECTIONS))}")
    for section, keys in SECTIONS.items():
        entries = data.get(section, [])
        for index, entry in enumerate(entries if isinstance(entries, list) else [entries]):
            for key in entry if keys is not None else []:
                if key not in keys:
                    fail(section, key, f"unknown key; expected some of {', '.join(sorted(keys))}", index)
    agents = {}
    for entry in data.get("agent", []):
        command = entry.get("command")
        if not isinstance(entry.get("name"), str):
            fail("agent", "name", "a string is required")
        if ("command" in entry) == ("entry" in entry):
            fail("agent", None, f"{entry['name']!r}: give either command (black-box) or entry (white-box)")
        if "entry" in entry and not (isinstance(entry["entry"], str)
                                     and re.fullmatch(r"[\w.]+:\w+", entry["entry"])):
            fail("agent", "entry", "'module:function' is required")
        if "command" in entry and not (isinstance(command, list) and command
                                       and all(isinstance(c, str) for c in command)):
            fail("agent", "command", "a non-empty list of strings is required")
        if entry.get("input", "stdin") not in ("stdin", "argument", "file"):
            fail("agent", "input", "must be stdin, argument or file")
        if not isinstance(entry.get("env", {}), dict):
            fail("agent", "env", "must be a table")
        if "prompt_tokens" in entry and not _positive_int(entry["prompt_tokens"]):
            fail("agent", "prompt_tokens", "a positive integer is required")
        agents[entry["name"]] = Agent(**entry)
    datasets, publics, library_paths = {}, {}, {}
    for index, entry in enumerate(data.get("dataset", [])):
        def fail_here(key, message, index=index):
            fail("dataset", key, message, index)

        if not isinstance(entry.get("name"), str):
            fail_here("name", "a string is required")
        if ("path" in entry) == ("source" in entry):
            fail_here(None, f"{entry['name']!r}: give either path (a file) or source (a library's tasks)")
        if "path" in entry:
            if not isinstance(entry["path"], str):
                fail_here("path", "a string is required")
            for key in sorted(sources.SOURCE_KEYS & set(entry)):
                fail_here(key, "applies to a source, not a path")
            datasets[entry["name"]] = dataset_path(entry["path"], path.parent)
        else:
            sources.check(entry, fail_here)
            datasets[entry["name"]] = sources.materialise(entry, fail_here)
            library_paths[entry["name"]] = sources.library_paths(entry["source"])
        public = entry.get("public", [])
        if not (isinstance(public, list) and all(isinstance(p, str) for p in public)):
            fail_here("public", "a list of task field names is required")
        publics[entry["name"]] = public
    run = data.get("run")
    if not isinstance(run, dict):
        fail("run", None, "a [run] table is required")
    for key in ("agent", "dataset"):
        if key not in run:
            fail("run", None, f"{key!r} is required")
    names = run["agent"] if isinstance(run["agent"], list) else [run["agent"]]
    if not names or not all(isinstance(n, str) for n in names):
        fail("run", "agent", "an agent name or a list of them is required")
    for name in names:
        if name not in agents:
            fail("run", "agent", f"no [[agent]] named {name!r}")
    run["agent"] = names
    if run["dataset"] not in datasets:
        fail("run", "dataset", f"no [[dataset]] named {run['dataset']!r}")
    for key in ("n", "concurrency", "max_new_tokens"):
        if key in run and not _positive_int(run[key]):
            fail("run", key, "a positive integer is required")
    if "timeout" in run and not (isinstance(run["timeout"], (int, float)) and run["timeout"] > 0):
        fail("run", "timeout", "a positive number of seconds is required")
    if "policy_version" in run:
        run["policy_version"] = str(run["policy_version"])
    if "seed" in run and (isinstance(run["seed"], bool) or not isinstance(run["seed"], int) or run["seed"] < 0):
        fail("run", "seed", "a non-negative integer is required")
    _check_executor(run, data, fail)
    _check_run_folders(run, path, fail)
    route = data.get("route", {})
    if "base_url" in route and not (isinstance(route["base_url"], str)
                                    and re.match(r"https?://[^/]", route["base_url"])):
        fail("route", "base_url", "an http:// or https:// URL is required")
    if isinstance(route.get("engines"), str):
        route["engines"] = [route["engines"]]
    if not (isinstance(route.get("engines", []), list) and all(isinstance(e, str) for e in route.get("engines", []))):
        fail("route", "engines", "a host[:port] or a list of them is required")
    if not isinstance(route.get("reverse", False), bool):
        fail("route", "reverse", "true or false")
    if route.get("reverse") and not route.get("base_url"):
        fail("route", "reverse", "needs route.base_url (the upstream the reverse proxy forwards to)")
    running = isinstance(data.get("proxy"), dict) and data["proxy"].get("url")
    if route.get("reverse") and running:
        fail("route", "reverse", "needs the proxy the runner starts (leave out proxy.url)")
    if route.get("engines") and running:
        fail("route", "engines", "applies to the proxy the runner starts; start yours with "
                                 "--set stepmill_engine_hosts=host:port (or leave out proxy.url)")
    if "tokenizer" in route:
        if not isinstance(route["tokenizer"], str):
            fail("route", "tokenizer", "a path is required")
        route["tokenizer"] = str((path.parent / os.path.expanduser(route["tokenizer"])).resolve())
    if any(a.entry for a in agents.values() if a.name in names) and not route.get("base_url"):
        fail("route", None, "white-box agents need route.base_url (the engine they generate with)")
    isolation = data.get("isolation", {})
    if isolation.get("mode", "auto") not in MODES:
        fail("isolation", "mode", f"must be one of {', '.join(MODES)}")
    if "first_uid" in isolation and not (isinstance(isolation["first_uid"], int) and 0 < isolation["first_uid"] < 2**31):
        fail("isolation", "first_uid", "a positive uid is required")
    if "prefix" in isolation and not (isinstance(isolation["prefix"], list) and isolation["prefix"]
                                      and all(isinstance(p, str) for p in isolation["prefix"])):
        fail("isolation", "prefix", "a non-empty list of strings is required")
    if "pass_env" in isolation and not (isinstance(isolation["pass_env"], list)
                                        and all(isinstance(n, str) and n.rstrip("*") for n in isolation["pass_env"])):
        fail("isolation", "pass_env", 'a list of variable names (or prefixes like "CUDA_*") is required')
    if isolation.get("mode") == "container" and "prefix" not in isolation:
        fail("isolation", "prefix", "mode = container needs the container command as prefix")
    return Config(path, agents, datasets, RolloutSettings(**run), data.get("proxy", {}), bool(data.get("reward")),
                  EngineRoute(**route), publics, Isolation(**isolation), library_paths=library_paths, tables=data)
