"""``stepmill train`` in a child process that has torch, without loading torch here: this interpreter's
own when it has torch (``pip install 'stepmill[torch]'``), else the engine venv's packages after this
interpreter's own (the way .ci/pytest-torch runs the tests): the demo and the tests start a trainer so."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from stepmill.errors import ConfigError

EXTRA_SITES = "STEPMILL_EXTRA_SITES"  # paths put after this interpreter's own in the child (os.pathsep-separated)
_BOOT = ("import os, sys; sys.path += [p for p in os.environ.get('STEPMILL_EXTRA_SITES', '').split(os.pathsep) if p]; "
         "sys.argv[0] = 'stepmill'; from stepmill.cli import main; main()")


def torch_sites() -> list[str]:
    """Where torch comes from for a child: ``$STEPMILL_EXTRA_SITES`` when set (this process found torch
    there too), else nothing more when this interpreter has torch, else the engine venv's site-packages
    (stepmill.demo.main.vllm_python)."""
    given = [p for p in os.environ.get(EXTRA_SITES, "").split(os.pathsep) if p]
    if given:
        return given
    if importlib.util.find_spec("torch") is not None:
        return []
    from stepmill.demo.main import vllm_python

    python = vllm_python()
    if python is None:
        raise ConfigError("stepmill train needs torch: pip install 'stepmill[torch]', or .ci/install-engines "
                          "(whose engine venv has it)")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return [site]


def trainer_command(*args: str) -> tuple[list[str], dict]:
    """(argv, env) of ``stepmill train ARGS`` with torch."""
    sites = torch_sites()
    env = {**os.environ, EXTRA_SITES: os.pathsep.join(sites)}
    if not sites:
        return [sys.executable, "-m", "stepmill.cli", "train", *args], env
    return [sys.executable, "-c", _BOOT, "train", *args], env


__all__ = ["trainer_command", "torch_sites", "EXTRA_SITES"]
