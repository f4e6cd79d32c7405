"""stepmill's mitmproxy options: a value outside an option's choices is refused with a clear message
before anything starts (no database, no journal, no writer), under mitmdump and `stepmill proxy`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stepmill.addon import SCRIPT
from stepmill.children import free_port

from .conftest import STEPMILL

MITMDUMP = [sys.executable, "-c", "from mitmproxy.tools.main import mitmdump; mitmdump()"]


def run_in(folder: Path, command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["mitmdump", "stepmill proxy"])
@pytest.mark.parametrize("option, value", [("stepmill_writer", "thred"), ("stepmill_writer_priority", "lowest"),
                                           ("stepmill_durability", "fsync"),
                                           ("stepmill_max_body", "-1")])
def test_a_bad_value_fails_before_anything_starts(tmp_path, how, option, value):
    confdir = tmp_path / "mitm"
    if how == "mitmdump":
        command = MITMDUMP + ["-s", SCRIPT, "--listen-port", str(free_port()), "--set", f"confdir={confdir}",
                              "--set", f"{option}={value}"]
    else:
        command = STEPMILL + ["proxy", "--port", str(free_port()), "--confdir", str(confdir),
                              "--set", f"{option}={value}"]
    done = run_in(tmp_path, command)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert f"{option} must be" in output
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "mitm")
    assert left == [], f"files made before the option was refused: {left}"
    assert "writing steps to" not in output


def test_choices_are_declared():
    """mitmproxy lists the choices in its option reference (``--options``)."""
    done = subprocess.run(MITMDUMP + ["-s", SCRIPT, "--options"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    reference = " ".join(line.lstrip("# ") for line in done.stdout.splitlines())
    assert "Valid values are 'process', 'thread'." in reference
    assert "Valid values are 'idle', 'low', 'normal'." in reference
