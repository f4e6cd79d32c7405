"""Whether a test of sandboxed runs can run here: skipped only where bubblewrap itself cannot (not
installed, namespaces refused by the host); where bare bubblewrap runs and stepmill's sandbox does not,
that is stepmill's failure, and the test fails with the reason."""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

from stepmill.runner import isolation as iso


@functools.lru_cache(maxsize=1)
def _bare_bwrap_problem() -> str | None:
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap is not installed (Debian: apt-get install bubblewrap)"
    bare = [path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "true"]
    result = subprocess.run(bare, capture_output=True, timeout=30)
    if result.returncode != 0:
        return f"bubblewrap cannot run here: {result.stderr.decode(errors='replace').strip()[:300]}"
    return None


def need_sandbox() -> None:
    """Skip where bubblewrap cannot run at all; fail where it can and stepmill's sandbox cannot."""
    if _bare_bwrap_problem():
        pytest.skip(_bare_bwrap_problem())
    if iso.bwrap_problem():
        pytest.fail(f"bare bubblewrap runs here, stepmill's sandbox does not: {iso.bwrap_problem()}")
