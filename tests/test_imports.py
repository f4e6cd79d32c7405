"""Each process of `stepmill proxy` loads what its room needs: the proxy's workers and writers none of
the heavy libraries other rooms use (tokenizers, numpy, the UI, the fleet, torch), and the supervisor
of `--workers N`, which serves nothing, no part of mitmproxy's proxy and no store either.

Each is checked in a fresh interpreter, by what its start imports (its ``sys.modules``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

# Loaded only where and when they are used: in the trainer bridge, the UI, the fleet, the tokenizer.
HEAVY = ["transformers", "tokenizers", "numpy", "pandas", "pyarrow", "datasette", "jinja2", "flask", "ray",
         "psycopg", "torch", "stepmill.ui", "stepmill.fleet", "stepmill.trainer_bridge"]
# The supervisor binds sockets and starts processes: the proxy, its addon and the store are its workers'.
NOT_IN_THE_SUPERVISOR = HEAVY + ["mitmproxy.tools", "mitmproxy.master", "mitmproxy.addons", "mitmproxy.proxy.server",
                                 "mitmproxy.proxy.layers", "mitmproxy.certs", "stepmill.proxy_master",
                                 "stepmill.addon.main", "stepmill.pipeline", "stepmill.store", "sqlite_utils"]

# What `python -m stepmill.pipeline.writer` and `python -m stepmill.proxy_master` import before they run.
WRITER = "import stepmill.pipeline.writer"
WORKER = "import stepmill.proxy_master"
# `stepmill proxy --workers 2` itself, run up to where it would start its workers: there the supervisor
# holds what it will hold while it serves (``supervise`` answers with its modules instead of starting any).
SUPERVISOR = """
import json, sys
import stepmill.proxy_supervisor

def supervise(args, workers, shared):
    print(json.dumps(sorted(sys.modules)))
    return 0

stepmill.proxy_supervisor.supervise = supervise
from stepmill.cli import main
sys.argv = ["stepmill", "proxy", "--workers", "2", "--port", "{port}", "--db", {db!r}, "--confdir", {confdir!r}]
main()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loaded(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def found(modules: set[str], names: list[str]) -> list[str]:
    """Which of ``names`` are loaded, themselves or any module inside them."""
    return [name for name in names if any(m == name or m.startswith(name + ".") for m in modules)]


@pytest.mark.parametrize("process, code", [("writer", WRITER), ("worker", WORKER)])
def test_the_proxy_processes_load_no_heavy_library(process, code):
    assert not found(loaded(code), HEAVY), f"the proxy's {process} imports them at start"


def test_the_supervisor_loads_no_proxy_and_no_store(tmp_path):
    confdir = str(tmp_path / "confdir")
    # the CA exists, as at every start but the first (making it loads mitmproxy's certificate code once)
    subprocess.run([sys.executable, "-c", f"from stepmill.runner.proxy_env import ensure_ca; ensure_ca({confdir!r})"],
                   check=True)
    code = SUPERVISOR.format(port=free_port(), db=str(tmp_path / "steps.db"), confdir=confdir)
    modules = loaded(code)
    assert "stepmill.cli.capture" in modules  # the real command ran
    assert not found(modules, NOT_IN_THE_SUPERVISOR)


def test_the_check_sees_a_heavy_import():
    """The checks above would fail: a module that imports numpy is seen, through a submodule too."""
    assert found(loaded("import numpy.linalg"), HEAVY) == ["numpy"]
