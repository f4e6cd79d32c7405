"""The fleet page's recipe as written (docs/fleet/index.md, "Try it on one machine"): its blocks are read
from the page and run in order — `stepmill fleet up` (a PostgreSQL coordinator and two local Ray nodes),
the rollout with the lines up wrote (its nodes' files served on after it: serve = "keep"), `stepmill fleet`
(two nodes), the trainer after the rollout (every group trained on once), `stepmill fleet down` (no PostgreSQL, raylet or other process of that cluster left).

The page's `~/fleet` is a temporary folder here, and its `stepmill simulate-llm --port 8000` is the
session's simulated LLM, on a port of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from .conftest import STEPMILL, wait_until
from .fleet_processes import acks_by_group
from .test_ray_rollout import _left_behind

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stepmill[fleet]'")
pytestmark = pytest.mark.slow

PAGE = Path(__file__).parent.parent / "docs" / "fleet" / "index.md"
SECTION = "## Try it on one machine"
FILES = {"json": "tasks.jsonl", "toml": "rollout.toml", "python": "trainer.py"}  # as the page names them
GROUPS = 4  # the page's four tasks, n = 2


def _blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the page's section, in order."""
    section = PAGE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def _as_here(text: str, fleet_dir: Path, llm_url: str) -> str:
    return text.replace("~/fleet", str(fleet_dir)).replace("http://127.0.0.1:8000/v1", llm_url)


class Recipe:
    """Runs the page's shell lines, one by one, as a user would in one shell (in ``cwd``)."""

    def __init__(self, cwd: Path):
        self.cwd, self.env, self.background, self.done = cwd, dict(os.environ), [], {}

    def run(self, line: str) -> None:
        words = shlex.split(line)
        if words[:2] == ["stepmill", "simulate-llm"]:
            return  # the session's simulated LLM serves instead
        if words[0] == "cat" and words[2] == ">>":
            with (self.cwd / words[3]).open("a") as out:
                out.write(Path(words[1]).read_text())
            return
        if words[-1] == "&":
            log = (self.cwd / f"background-{len(self.background)}.log").open("wb")
            self.background.append(subprocess.Popen(self._argv(words[:-1]), cwd=self.cwd, env=self.env,
                                                    stdout=log, stderr=subprocess.STDOUT))
            return
        done = subprocess.run(self._argv(words), cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        self.done[line] = done
        exported = re.findall(r"^export STEPMILL_COORDINATOR=(\S+)$", done.stdout, flags=re.M)
        if exported:  # the page: "run it"
            self.env["STEPMILL_COORDINATOR"] = exported[0]

    @staticmethod
    def _argv(words: list[str]) -> list[str]:
        if words[0] == "stepmill":
            return STEPMILL + words[1:]
        if words[0] == "python":
            return [sys.executable, *words[1:]]
        raise AssertionError(f"the page runs {words[0]!r}, which this test does not know how to run")


def _postgres_left(data: Path) -> list[str]:
    return [line for line in _left_behind(str(data)) if "postgres" in line]


def _clean_up(fleet_dir: Path, recipe: Recipe) -> None:
    for process in recipe.background:
        if process.poll() is None:
            process.terminate()
            process.wait(30)
    subprocess.run(STEPMILL + ["fleet", "down", "--dir", str(fleet_dir)], capture_output=True, timeout=300)
    from stepmill.fleet.local_ray import temp_folder

    shutil.rmtree(temp_folder(fleet_dir), ignore_errors=True)
    shutil.rmtree((fleet_dir / "postgres").resolve(), ignore_errors=True)


@pytest.mark.timeout(1500)
def test_the_fleet_page_runs_as_written(simulated_llm, tmp_path):
    from stepmill.fleet.local_coordinator import missing_reason
    from stepmill.fleet.local_ray import cluster_processes, temp_folder
    from stepmill.store.fleet_ledger import Coordinator

    if missing_reason():
        pytest.skip(missing_reason())
    fleet_dir = tmp_path / "fleet"
    blocks = [(language, _as_here(text, fleet_dir, simulated_llm.url)) for language, text in _blocks()]
    assert [language for language, _ in blocks] == ["sh", "json", "toml", "sh", "python", "sh"], blocks
    for language, text in blocks:
        if language in FILES:
            (tmp_path / FILES[language]).write_text(text)
    up, rollout_and_trainer, down = [[line for line in text.splitlines() if line.strip()]
                                     for language, text in blocks if language == "sh"]
    recipe = Recipe(tmp_path)
    try:
        for line in up:
            recipe.run(line)
        started = recipe.done[up[0]].stdout
        assert "(started: PostgreSQL on 127.0.0.1:" in started and "started: 2 nodes alive" in started, started
        run_lines = (fleet_dir / "fleet.toml").read_text()
        recipe.run(up[0])  # up again: both reused, the same lines
        again = recipe.done[up[0]].stdout
        assert "(running already: PostgreSQL" in again and "(running already: 2 nodes alive" in again, again
        assert (fleet_dir / "fleet.toml").read_text() == run_lines

        for line in rollout_and_trainer:
            recipe.run(line)
        rollout = recipe.done["stepmill rollout rollout.toml"].stderr
        assert "8 runs finished (0 failed, 0 timed out), 0 done earlier, of 8" in rollout, rollout
        state = recipe.done["stepmill fleet"].stdout
        assert len(re.findall(r"^node node-\S+: alive", state, flags=re.M)) == 2, state
        assert f"ready {GROUPS}" in state, state
        trainer = recipe.done["python trainer.py"]
        trained = Counter(re.findall(r"^group (\S+): \d+ rows$", trainer.stdout, flags=re.M))
        assert len(trained) == GROUPS and set(trained.values()) == {1}, trainer.stdout + trainer.stderr
        with Coordinator(recipe.env["STEPMILL_COORDINATOR"]) as fleet:
            assert fleet.counts()["acked"] == GROUPS
            assert acks_by_group(fleet, trained) == Counter(trained)
        # serve = "keep": the nodes' files were served after the rollout by a process of each node's, which
        # stops by itself once every group of its node is consumed.
        nodes = (fleet_dir / "nodes").resolve()
        assert len(list(nodes.glob("*.keep.pid"))) == 2, sorted(p.name for p in nodes.iterdir())
        wait_until(lambda: not _left_behind(f"--node-dir {nodes}"), timeout=120, interval=0.5,
                   what="the kept serving to stop once every group is consumed")
        assert all("is consumed" in log.read_text() for log in nodes.glob("*.keep.log"))

        data = (fleet_dir / "postgres").resolve() / "data"
        assert _postgres_left(data) and cluster_processes(temp_folder(fleet_dir)), "nothing ran before down"
        for line in down:
            recipe.run(line)
        assert not _postgres_left(data), "a PostgreSQL process outlived `stepmill fleet down`"
        assert not cluster_processes(temp_folder(fleet_dir)), "a Ray process outlived `stepmill fleet down`"
        assert not _left_behind("raylet " + f"--raylet_socket_name={temp_folder(fleet_dir)}")
    finally:
        _clean_up(fleet_dir, recipe)
