"""The documentation: the site builds with --strict, the README stays short, and every repository path
or stepmill module the README, the pages or a code comment names exists (tests/doc_paths.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .doc_paths import ROOT, Name, exists, missing, names_in

# Wrong names in comments the documentation's owner does not edit, each with its fix; the test fails
# on any other, and on one of these once it is fixed (so the list only shrinks).
KNOWN_WRONG: dict = {}


def test_the_site_builds_strict(tmp_path):
    """A broken link or anchor, a page left out of nav, a bad configuration: any warning fails."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_readme_stays_a_readme():
    """What stepmill is, the two commands, a quick start and a map; the rest is on the site."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 350
    assert "make demo" in readme.split("\n\n", 2)[1] and "make test" in readme.split("\n\n", 2)[1]


def test_every_named_path_exists():
    found = missing()
    wrong = [name for name in found if (name.source, name.text) not in KNOWN_WRONG]
    assert not wrong, "named but not in the repository:\n" + "\n".join(
        f"  {name.source}:{name.line}: {name.text}" for name in wrong)
    fixed = set(KNOWN_WRONG) - {(name.source, name.text) for name in found}
    assert not fixed, f"fixed, so take them out of KNOWN_WRONG: {sorted(fixed)}"


@pytest.mark.parametrize(("text", "expected"), [
    ("see `store/db.py` and tests/test_architecture.py.", ["store/db.py", "tests/test_architecture.py"]),
    ("`tests/test_real_vllm.py::test_recipe_against_the_real_vllm`", ["tests/test_real_vllm.py::test_recipe_against_the_real_vllm"]),
    ("runs `.ci/run`; the folder store/ holds it", [".ci/run", "store/"]),
    ("`stepmill.store.views` and `stepmill.rewards.functions:math_answer`",
     ["stepmill.store.views", "stepmill.rewards.functions:math_answer"]),
])
def test_the_finder_finds_paths_and_modules(text, expected):
    assert [name.text for name in names_in(text)] == expected


@pytest.mark.parametrize("text", [
    "trainers and/or agents, input/output, the README/docs text",
    "POST /v1/steps, GET /-/stepmill/steps/<id>, `<db>.journal/<id>/*.seg`",
    "http://example.com/store/db.py and https://stepmill.local/v1/health",
    "stepmill.db, stepmill.db-wal, `stepmill-demo/rollout.toml`, ~/stepmill/x.py",
    "`tests/test_*.py`, `docs/{page}.md`, `stepmill/<room>/`",
])
def test_the_finder_leaves_prose_alone(text):
    assert names_in(text) == []


def test_a_link_on_a_page_is_relative_to_the_page():
    assert [n.text for n in names_in("[UI](store/ui.md)", page_folder="docs")] == ["docs/store/ui.md"]
    assert [n.text for n in names_in("[UI](docs/store/ui.md)")] == ["docs/store/ui.md"]


@pytest.mark.parametrize(("text", "kind", "there"), [
    ("store/db.py", "path", True),
    ("store/nothing_here.py", "path", False),
    ("tests/test_docs.py::test_a_wrong_name_is_missing", "path", True),
    ("tests/test_docs.py::test_nothing_of_that_name", "path", False),
    ("stepmill.store.views", "module", True),
    ("stepmill.stroe.views", "module", False),
    ("stepmill.rewards.functions:math_answer", "module", True),
    ("stepmill.rewards.functions:no_such_function", "module", False),
    ("stepmill.trainer_bridge.consume", "module", True),
    ("stepmill.addon.main.StepmillAddon", "module", True),
    ("stepmill.addon.main.NoSuchAddon", "module", False),
])
def test_a_wrong_name_is_missing(text, kind, there):
    assert exists(Name(text, kind, "<test>", 1)) is there
