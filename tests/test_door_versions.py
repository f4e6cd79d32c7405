"""A white-box step's policy version is what the runner saw its engine answer, never a field of the
run's own lines, and a step no engine answer backs is not the run's to make: a real sandboxed
white-box run (tests/adversary/door_versions.py) generates once through its engine door, then writes
lines claiming ``weight_versions: [{"version": "999"}]`` for those very output ids again and for ids
the engine never answered. The honest step carries the version the engine named and the time the
door saw its request; the two forged lines are refused ("no engine answer carried these ids"),
never stamped by the clock; none says 999. Then it sends its engine door a 300 MiB body (answered
413 before the runner holds it) and a request on a route no run needs (refused: the door is an
allow-list of inference routes).
"""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from stepmill.store import Store

from .conftest import TESTS
from .test_adversarial import TASKS, run_rollout, stop_stack
from .test_door_reach import sandbox_stack


def _label(simulated_llm, version: str) -> None:
    """The engine's own weight version label (vLLM's /update_weight_version), set as a trainer would."""
    request = urllib.request.Request(simulated_llm.url.removesuffix("/v1") + "/update_weight_version",
                                     data=json.dumps({"new_version": version}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_white_box_run_chooses_no_version_forges_no_step_and_sends_no_huge_body(simulated_llm, tmp_path_factory):
    stack = sandbox_stack(simulated_llm, tmp_path_factory, "door-versions")
    marker = stack.marker
    agents = (f'[[agent]]\nname = "wb"\nentry = "tests.adversary.door_versions:run"\n'
              f'env = {{ PYTHONPATH = "{TESTS.parent}" }}\n')
    _label(simulated_llm, f"engine-{marker}")
    try:
        rollout = run_rollout(stack, "claim", agents=agents, run_agents=["wb"], tasks=TASKS[:1], concurrency=1)
    finally:
        _label(simulated_llm, "default")  # the shared engine back as it was: unlabelled
        stop_stack(stack)
    trajectory = f"claim-{marker}-t01-0"
    try:
        store = Store(str(stack.db))
        try:
            steps = store.query("SELECT step_index, policy_version, metadata FROM steps WHERE trajectory_id = ?"
                                " ORDER BY step_index", [trajectory])
        finally:
            store.close()
        versions = [step["policy_version"] for step in steps]
        assert "999" not in versions, f"a run chose its own policy version: {versions}"
        assert versions == [f"engine-{marker}"], f"a step no engine answer backs was kept: {versions}"
        assert json.loads(steps[0]["metadata"] or "{}").get("version_from") == "engine", steps[0]
        errors = rollout.trajectories[trajectory]["metadata"].get("submit_errors", [])
        assert [error for error in errors if "no engine answer carried these ids" in error] == errors, errors
        assert len(errors) == 2, errors
        budget = next(line for line in rollout.logs[trajectory].splitlines() if line.startswith("BODY-BUDGET"))
        assert " 413 " in budget and "at most 67108864 bytes" in budget, f"the door carried a 300 MiB body: {budget}"
        route = next(line for line in rollout.logs[trajectory].splitlines() if line.startswith("NEW-ROUTE"))
        assert " 403 " in route and "inference routes alone" in route, f"the door opened a route no run needs: {route}"
    finally:
        shutil.rmtree(stack.base, ignore_errors=True)  # the runs' folders too: beside its database
