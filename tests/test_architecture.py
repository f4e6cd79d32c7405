"""The house rules, read from the source: which room may import which, and SQL only in the store.

Rooms are packages (README: Architecture). A room imports its own modules, the foundation and
the rooms below it, never one above; imports inside functions count too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"addon": "stepmill.addon", "store": "stepmill.store", "trainer_bridge": "stepmill.trainer_bridge",
           "stepmill": "stepmill"}

# Room -> the modules it holds (longest prefix wins).
ROOMS = {
    "foundation": ("stepmill", "stepmill.errors", "stepmill.protocols", "stepmill.tags", "stepmill.auth",
                   "stepmill.private_files", "stepmill.children", "stepmill.qwen_vocab", "stepmill.http_answers"),
    "store": ("stepmill.store",),
    "pipeline": ("stepmill.pipeline",),
    "api": ("stepmill.api",),
    "addon": ("stepmill.addon",),
    "rewards": ("stepmill.rewards",),
    "bridge": ("stepmill.trainer_bridge",),
    "ui": ("stepmill.ui",),
    "client": ("stepmill.client",),
    "agents": ("stepmill.agents",),
    "runner": ("stepmill.runner",),
    "fleet": ("stepmill.fleet",),
    "simulated_llm": ("stepmill.simulated_llm",),
    "proxy": ("stepmill.proxy_master", "stepmill.proxy_supervisor", "stepmill.proxy_onboarding"),
    "train": ("stepmill.train",),
    "demo": ("stepmill.demo",),
    "experiment": ("stepmill.experiment",),
    "cli": ("stepmill.cli",),
}
# Room -> the rooms it may import besides itself and the foundation. Nothing upward.
MAY_IMPORT = {
    "foundation": set(),
    "store": set(),
    "pipeline": {"store"},
    "api": {"store", "pipeline"},
    "addon": {"pipeline", "api"},  # never the store: the event loop hands records to the pipeline
    "rewards": {"store"},
    "bridge": {"store"},
    "ui": {"store", "bridge", "rewards"},
    "client": set(),
    "agents": {"client"},
    "runner": {"store", "rewards", "client"},
    # The fleet runs the runner's runs on a cluster and serves the bridge's batches; its ledger is the store's.
    "fleet": {"store", "bridge", "runner", "rewards"},
    "simulated_llm": {"agents"},
    "proxy": {"addon", "pipeline"},
    "train": {"store", "bridge", "rewards", "runner", "client", "fleet"},  # torch only here
    "demo": set(ROOMS) - {"cli", "demo", "experiment"},
    # Matrices of the demo's closed loop: what the demo may use, and the demo.
    "experiment": set(ROOMS) - {"cli", "experiment"},
    "cli": set(ROOMS) - {"cli"},
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def room_of(module: str) -> str | None:
    best, best_len = None, -1
    for room, prefixes in ROOMS.items():
        for prefix in prefixes:
            # the bare package holds only its own __init__: a new module must be given a room
            inside = module.startswith(prefix + ".") and prefix != "stepmill"
            if (module == prefix or inside) and len(prefix) > best_len:
                best, best_len = room, len(prefix)
    return best


def imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module imported) for every stepmill import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from stepmill import tags` imports the module stepmill.tags
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in out if name == "stepmill" or name.startswith("stepmill.")]


def test_every_module_belongs_to_a_room():
    assert not [m for m in modules() if room_of(m) is None]


def test_the_rooms_form_layers():
    """The allowed imports have no cycle, so "above" and "below" mean something."""
    done = set()

    def visit(room, trail):
        assert room not in trail, f"cycle: {' -> '.join(trail + [room])}"
        if room in done:
            return
        for below in MAY_IMPORT[room]:
            visit(below, trail + [room])
        done.add(room)

    for room in ROOMS:
        visit(room, [])


def test_no_room_imports_upward():
    known = modules()
    wrong = []
    for module, path in known.items():
        here = room_of(module)
        for line, name in imports(module, path):
            # `from pkg import name` names a module or an attribute; the module is the longest known prefix
            target = name if name in known else name.rpartition(".")[0]
            there = room_of(target)
            if there is None or there == here or there == "foundation" or there in MAY_IMPORT[here]:
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {target} ({there})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def reachable(room: str) -> set[str]:
    """The rooms a room may import, directly or through the rooms it may import."""
    found, todo = set(), [room]
    while todo:
        for below in MAY_IMPORT[todo.pop()] - found:
            found.add(below)
            todo.append(below)
    return found


def test_the_fleet_stands_on_the_store_and_the_runner_never_the_reverse():
    """The table says so, and so do the imports themselves (every one, those inside functions too)."""
    assert {"store", "runner"} <= MAY_IMPORT["fleet"]
    assert [room for room in ROOMS if "fleet" in reachable(room)] == ["train", "demo", "experiment", "cli"]
    graph = import_graph()
    into_fleet = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                        if room_of(target) == "fleet" and room_of(module) not in ("fleet", "train", "demo", "experiment", "cli"))
    assert not into_fleet, "imports of the fleet from below it:\n" + "\n".join(into_fleet)
    fleet_uses = {room_of(target) for module, targets in graph.items() if room_of(module) == "fleet" for target in targets}
    assert "store" in fleet_uses  # the ledger and the steps: the fleet stands on the store


# The wire formats of LLM APIs stand alone: their modules import each other and stepmill's errors only,
# never the pipeline that records them (nor anything else of stepmill).
PROTOCOLS_MAY_IMPORT = ("stepmill.protocols", "stepmill.errors")


def test_the_protocols_import_nothing_of_the_pipeline():
    known = modules()
    wrong = []
    for module, path in known.items():
        if not module.startswith("stepmill.protocols"):
            continue
        for line, name in imports(module, path):
            target = name if name in known else name.rpartition(".")[0]
            if not any(target == allowed or target.startswith(allowed + ".") for allowed in PROTOCOLS_MAY_IMPORT):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    assert not wrong, "the protocols import beyond themselves:\n" + "\n".join(wrong)


def import_graph() -> dict[str, set[str]]:
    """Module -> the stepmill modules it imports (at the top or inside functions), each ``from pkg import
    name`` resolved to the module it names or, for an attribute, the module that holds it."""
    known = modules()
    graph = {}
    for module, path in known.items():
        targets = {name if name in known else name.rpartition(".")[0] for _, name in imports(module, path)}
        graph[module] = {target for target in targets if target in known and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first again at the end) for each import that closes one."""
    found, done, trail = [], set(), []
    on_trail: dict[str, int] = {}

    def visit(module: str) -> None:
        on_trail[module] = len(trail)
        trail.append(module)
        for target in sorted(graph.get(module, ())):
            if target in on_trail:
                found.append(trail[on_trail[target]:] + [target])
            elif target not in done:
                visit(target)
        trail.pop()
        del on_trail[module]
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def test_the_module_imports_have_no_cycle():
    """A cycle makes the import order matter (a name read before its module finished running) and ties two
    modules into one: the shared piece belongs in a module both import."""
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"a"}}, [["a", "a"]]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_names_each_cycle(graph, expected):
    assert cycles(graph) == expected


SQL = re.compile(r"\b(?:SELECT\b.+\bFROM|INSERT\s+(?:OR\s+\w+\s+)?INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|PRAGMA\s+\w+"
                 r"|CREATE\s+(?:UNIQUE\s+)?(?:TABLE|INDEX|VIEW|TRIGGER)|ALTER\s+TABLE|DROP\s+(?:TABLE|INDEX))\b"
                 # a condition handed to the store as text: "s.group_id = ?", "t.id IN (", "s.x IS NULL"
                 r"|\b[a-z]\.\w+\s*(?:=|<|>|\bIN\b|\bLIKE\b|\bIS\b)\s*(?:\?|:\w+|\(|NULL\b)", re.S)
# Ways to hand SQL to a database from outside the store.
SQL_CALLS = re.compile(r"\.(?:execute|executemany|executescript)\(|\bstore\.query\(|\.db\.conn\b|\bsqlite3\b"
                       r"|\.write\(\) as conn\b")
# What of the store the other rooms may import: Store and its record type, the fleet's ledger, and
# the few vocabularies and formats its rows speak (timestamps, column codecs, curation's sources and
# labels); the UI also its page queries. Everything else in store/ is the store's own business.
STORE_SURFACE = {"stepmill.store", "stepmill.store.records", "stepmill.store.fleet_ledger", "stepmill.store.ids",
                 "stepmill.store.encoding", "stepmill.store.curation"}
STORE_SURFACE_FOR = {"ui": {"stepmill.store.views"}, "cli": {"stepmill.store.views"}, "demo": {"stepmill.store.views"}}


def docstrings(tree: ast.AST) -> set[int]:
    """Docstrings and help texts (a CLI option's example condition is prose for the user)."""
    ids = {id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
           for k in node.keywords if k.arg == "help"}
    ids |= {id(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
            and getattr(node.func, "id", None) == "where_options"}  # the --where option's help
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def sql_outside_the_store() -> list[str]:
    found = []
    for module, path in modules().items():
        if room_of(module) == "store":
            continue
        text = path.read_text()
        tree = ast.parse(text, str(path))
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and SQL.search(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: SQL text {node.value[:60]!r}")
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if SQL_CALLS.search(code):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    return found


def test_no_sql_outside_the_store():
    found = sql_outside_the_store()
    assert not found, "SQL outside store/:\n" + "\n".join(found)


def test_the_store_is_reached_through_its_surface():
    known = modules()
    wrong = []
    for module, path in known.items():
        here = room_of(module)
        if here == "store":
            continue
        for line, name in imports(module, path):
            target = name if name in known else name.rpartition(".")[0]
            if room_of(target) == "store" and target not in STORE_SURFACE | STORE_SURFACE_FOR.get(here, set()):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {target}")
    assert not wrong, "imports of the store's insides:\n" + "\n".join(wrong)


@pytest.mark.parametrize("text", ["SELECT id FROM steps WHERE x = ?", "s.trajectory_id IN (?, ?)", "s.group_id = ?", "INSERT OR REPLACE INTO state (k) VALUES (?)",
                                  "UPDATE consumption SET status = 'acked'", "PRAGMA data_version",
                                  "DELETE FROM steps", "CREATE INDEX i ON steps (id)"])
def test_the_sql_finder_finds_sql(text):
    assert SQL.search(text)


@pytest.mark.parametrize("text", ["Select the rows you want", "update the policy version", "s.status = 'ok'",
                                  "a.b = c", "e.g. \"s.status = 'ok'\"",
                                  "select a model from the list"])
def test_the_sql_finder_leaves_prose_alone(text):
    assert not SQL.search(text)


@pytest.mark.parametrize("folder", ["store", "addon", "trainer_bridge"])
def test_a_folder_loads_only_under_its_stepmill_name(folder):
    """From the repository root `import store` would load the same files a second time as another module."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and f"import stepmill.{folder}" in result.stderr
