"""CI's experiment cell: the shipped command on the shipped stepmill/data/experiments.ci.toml (the default
cell, one seed, two versions) end to end on the real vLLM: the run and its paired control trained and
measured, every group acknowledged once, their result kept, the report and the plot written; a second
invocation finds it done and starts no engine. It is CI's closed loop in sync mode with the black-box agent
through the proxy (tests/test_train_loop.py runs the async, white-box one)."""

import json
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import STEPMILL
from .real_engine import missing
from .test_train_loop import acked_once

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(1800)]

CI = Path(__file__).parent.parent / "stepmill" / "data" / "experiments.ci.toml"
CELL = "animals16-grpo-black-box"


def test_the_ci_cell_end_to_end(tmp_path):
    pytest.importorskip("torch")
    from stepmill.demo.main import vllm_python
    from stepmill.demo.trainer_child import trainer_command

    if vllm_python() is None:
        missing("vLLM is not installed: run .ci/install-engines")
    _, env = trainer_command()  # torch for the trainer child, wherever this interpreter found it
    folder = tmp_path / "experiments-ci"
    done = subprocess.run(STEPMILL + ["experiment", str(CI), "--folder", str(folder)], capture_output=True, text=True,
                          env=env, timeout=1700)
    logs = "".join(f"\n--- {log}\n{log.read_text(errors='replace')[-3000:]}" for log in folder.glob("runs/*/*/train.log"))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    result = json.loads((folder / "results" / CELL / "seed-0.json").read_text())
    assert [row["version"] for row in result["run"]] == [0, 1, 2]  # two trained versions and the last measured
    assert [row["version"] for row in result["control"]] == [0, 1, 2] and result["control_from"] is None
    assert all(0 <= row["reward"] <= 1 for row in result["run"] + result["control"])
    assert result["run"][0]["reward"] == pytest.approx(result["control"][0]["reward"], abs=0.05)  # the same weights
    trained = [row for row in result["run"] if "train_s" in row]
    assert len(trained) == 2 and all(row["tokens"] > 0 and row["sync_s"] > 0 for row in trained)
    assert max(row["rollout_gap"] for row in trained) < 1e-3  # each token checked against its version's weights
    # every group of the run and of its control (three versions of two prompts each) acknowledged exactly once
    db = folder / "runs" / CELL / "seed-0" / "stepmill.db"
    assert acked_once(db, "train") == acked_once(db, "train-control") == (6, 6)
    assert f"--cell {CELL} --seed 0 --again" in result["command"] and result["wall_s"] > 0
    report = (folder / "report.md").read_text()
    assert f"| `{CELL}` | 1 |" in report and result["command"] in report
    assert (folder / "plots" / f"{CELL}.png").read_bytes()[:4] == b"\x89PNG"
    started = time.monotonic()
    again = subprocess.run(STEPMILL + ["experiment", str(CI), "--folder", str(folder)], capture_output=True, text=True,
                           env=env, timeout=120)
    assert again.returncode == 0 and "1 of 1 runs finished, 0 to run" in again.stderr, again.stderr
    assert "starting vLLM" not in again.stderr and time.monotonic() - started < 60
