"""A white-box step's policy version is what the runner saw its engine answer, never a field of the
run's own lines: a real sandboxed white-box run (tests/adversary/door_versions.py) generates once
through its engine door, then writes lines claiming ``weight_versions: [{"version": "999"}]`` for
those very output ids and for ids the engine never answered. The first two steps carry the version
the engine named; the third, which no answer backs, is stamped by the clock; none says 999.
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
def test_a_white_box_line_that_claims_a_version_gets_the_engines_or_none(simulated_llm, tmp_path_factory):
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
        assert rollout.done.returncode == 0, rollout.done.stderr
        store = Store(str(stack.db))
        try:
            steps = store.query("SELECT step_index, policy_version, metadata FROM steps WHERE trajectory_id = ?"
                                " ORDER BY step_index", [trajectory])
        finally:
            store.close()
        versions = [step["policy_version"] for step in steps]
        assert "999" not in versions, f"a run chose its own policy version: {versions}"
        assert versions[:2] == [f"engine-{marker}"] * 2, versions  # what the engine said of those ids
        assert len(versions) == 3 and versions[2] == f"pv-{marker}", versions  # no answer backs it: the clock
        assert "version_from" not in json.loads(steps[2]["metadata"] or "{}"), steps[2]
    finally:
        shutil.rmtree(stack.base, ignore_errors=True)  # the runs' folders too: beside its database
