"""The runner's isolation choices beyond the sandbox (the adversarial suite attacks sandbox and user
mode): none says on every run that agents are not kept from their data; container runs the prefix
with its placeholders filled; user mode refuses a dataset other users can read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import STEPMILL

from .test_rollout import _config, _rollout

STAND_IN = """
import json, os, sys
# A stand-in for a container engine (none runs on these machines): note what it was given, then run.
args = sys.argv[1:]
env_file, workdir, uid, command = args[0], args[1], args[2], args[4:]
with open(os.path.join(workdir, "container.json"), "w") as out:
    json.dump({"env_file": env_file, "workdir": workdir, "uid": uid,
               "env": dict(line.split("=", 1) for line in open(env_file).read().splitlines() if line)}, out)
os.execvp(command[0], command)
"""


def test_none_says_on_every_run_that_agents_are_not_isolated(proxy, marker, tmp_path):
    config = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "print('ok')"],
                     extra='\n[isolation]\nmode = "none"\n')
    done = _rollout(config)
    assert "6 runs finished (0 failed, 0 timed out)" in done.stderr
    assert done.stderr.count("is NOT isolated (isolation = none)") == 6, done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="where the runner is not root, auto falls back to none")
def test_auto_refuses_to_run_as_root_where_bubblewrap_cannot_sandbox(proxy, marker, tmp_path):
    """A root runner whose bubblewrap cannot run (here: none on its PATH) would run each agent as root on the
    host under none: auto refuses the rollout, with the reason, before any run starts."""
    config = _config(tmp_path, proxy, marker, agent_command=[sys.executable, "-c", "print('ok')"])
    empty = tmp_path / "bin"
    empty.mkdir()
    done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": str(empty)})
    assert done.returncode != 0, done.stderr
    assert "isolation = auto: runs cannot be sandboxed here (bubblewrap is not installed" in done.stderr, done.stderr
    assert "would be root on the host" in done.stderr and "runs finished" not in done.stderr, done.stderr


def test_container_mode_runs_the_prefix_with_its_placeholders(proxy, marker, tmp_path):
    engine = tmp_path / "engine.py"
    engine.write_text(STAND_IN)
    prefix = [sys.executable, str(engine), "{env_file}", "{workdir}", "{uid}", "--"]
    config = _config(tmp_path, proxy, marker, extra=f'\n[isolation]\nmode = "container"\nprefix = {json.dumps(prefix)}\n')
    done = _rollout(config)
    assert "6 runs finished (0 failed, 0 timed out)" in done.stderr, done.stderr
    store = proxy.store()
    row = store.query("SELECT metadata FROM trajectories WHERE id = ?", [f"arith-{marker}-t0-0"])[0]
    metadata = json.loads(row["metadata"])
    seen = json.loads(open(f"{metadata['workdir']}/container.json").read())
    assert metadata["isolation"] == "container" and seen["workdir"] == metadata["workdir"]
    assert seen["env"]["HTTPS_PROXY"].startswith(f"http://arith-{marker}-t0-0:")  # its credentials, its secret
    assert "STEPMILL_TOKEN" not in seen["env"]
    assert not Path(seen["env_file"]).exists()  # the run's variables stay nowhere once it ended
    assert len(proxy.steps("s.trajectory_id LIKE ?", [f"arith-{marker}-%"], count=12)) == 12


def test_user_mode_refuses_a_dataset_other_users_can_read(proxy, marker, tmp_path):
    config = _config(tmp_path, proxy, marker, extra='\n[isolation]\nmode = "user"\n')
    (tmp_path / "tasks.jsonl").chmod(0o644)
    done = _rollout(config)
    assert done.returncode != 0
    assert "is readable by other users, agents included (its answers too): chmod go-r it" in done.stderr


def test_runs_get_no_coordinator_or_cluster_credentials():
    """A run's environment by allow-list: PATH, HOME, LANG, TERM and what [isolation] pass_env names;
    the fleet's secrets (the coordinator's URL, PostgreSQL's client settings, Ray's address), API keys
    and stepmill's own settings never, whatever pass_env says of them."""
    from stepmill.runner.isolation import agent_environment

    given = {"PATH": "/usr/bin", "HOME": "/home/x", "LANG": "C.UTF-8", "STEPMILL_COORDINATOR": "postgresql://u:pw@db/x",
             "PGPASSWORD": "pw", "PGSERVICEFILE": "/etc/pg_service.conf", "PGHOST": "db",
             "DATABASE_URL": "postgresql://u:pw@db/x", "RAY_ADDRESS": "10.0.0.1:6379", "OPENAI_API_KEY": "sk-x",
             "CUDA_VISIBLE_DEVICES": "0", "CUDA_HOME": "/usr/local/cuda", "STEPMILL_TOKEN": "t"}
    assert agent_environment(given) == {"PATH": "/usr/bin", "HOME": "/home/x", "LANG": "C.UTF-8"}
    assert agent_environment(given, ["CUDA_*", "STEPMILL_TOKEN"]) == {
        "PATH": "/usr/bin", "HOME": "/home/x", "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_HOME": "/usr/local/cuda"}


def test_pass_env_never_names_stepmills_own_variables(tmp_path):
    from stepmill.errors import ConfigError
    from stepmill.runner.isolation import Isolation

    import pytest

    with pytest.raises(ConfigError, match="stepmill's own variables are never passed on"):
        Isolation(pass_env=["STEPMILL_TOKEN"])
    assert Isolation(pass_env=["HF_HOME", "CUDA_*"]).pass_env == ["HF_HOME", "CUDA_*"]


def test_an_admin_route_is_recognised_however_its_path_is_written():
    from hypothesis import given, strategies as st

    from stepmill.auth.admin_routes import ADMIN_ROUTES, is_admin_route

    @given(st.sampled_from(sorted(ADMIN_ROUTES)), st.text(alphabet="abc=&1", max_size=8),
           st.sampled_from(["", "/", "//"]), st.sampled_from(["", "/v1/..", "/./", "/x/../"]), st.booleans())
    def check(route, query, trailing, before, encode):
        path = before.rstrip("/") + route + trailing
        if encode:  # servers decode percent-escapes before routing
            path = path.replace(route[1], f"%{ord(route[1]):02x}", 1)
        assert is_admin_route(path + (f"?{query}" if query else ""))

    check()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/health", "/tokenize"):
        assert not is_admin_route(path)
