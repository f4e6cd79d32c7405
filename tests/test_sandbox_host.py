"""A sandboxed run tries to take the host (tests/adversary/host_grab.py), started by the real runner
as users run it, while the runner is root (as here, and in CI): through kernel.core_pattern (a
program of its choosing run as root), the host's name, the kernel's keyrings (a key the host's root
keeps, a key another run keeps), a setuid-root binary, and the runner's API keys in its environment.
Two runs at once, each holding 40 processes under a limit of 48: each run's count is its own. Run
as root and as another user (docs/security/agents.md has both columns)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from stepmill.runner import isolation as iso

from .sandboxing import need_sandbox
from .conftest import STEPMILL, TESTS
from .rollout_files import write_rollout

GRAB = TESTS / "adversary" / "host_grab.py"
PORT_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")  # a run's own network opens its low ports
SYSTEM_PYTHON = "/usr/bin/python3"
REPORT = "STEPMILL-HOST-GRAB-REPORT "
RUNNER_SECRETS = {"OPENAI_API_KEY": "sk-runner-secret", "HF_TOKEN": "hf_runner_secret",
                  "AWS_SECRET_ACCESS_KEY": "aws-runner-secret", "AWS_ACCESS_KEY_ID": "AKIARUNNER"}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def add_host_key(description: str, payload: bytes) -> int:
    """A key in the test's (the host root's) user keyring, as a host service would keep a credential."""
    key = libc.syscall(248, b"user", description.encode(), payload, len(payload), ctypes.c_long(-4))
    if key < 0:
        pytest.skip(f"the kernel's keyrings are not usable here: {os.strerror(ctypes.get_errno())}")
    return key


def revoke_key(key: int) -> None:
    libc.syscall(250, 3, ctypes.c_long(key))  # KEYCTL_REVOKE


@pytest.fixture(scope="module", params=["sandbox", "user"])
def grabbed(request, proxy, tmp_path_factory):
    """The two runs' reports (keeper t01, reader t02), their trajectories, and the host before and after
    (put back where a run changed it: the code before this sandbox let it)."""
    mode = request.param
    # Before anything of stepmill runs here (its trial of bubblewrap too).
    before = {"core_pattern": Path("/proc/sys/kernel/core_pattern").read_text(), "hostname": socket.gethostname(),
              "port_start": PORT_START.read_text()}
    if mode == "sandbox":
        need_sandbox()
    if mode == "user" and os.geteuid() != 0:
        pytest.skip("isolation = user needs the runner to be root")
    marker = uuid.uuid4().hex[:10]
    base = Path(tempfile.mkdtemp(prefix="stepmill-grab-", dir="/var/tmp"))
    base.chmod(0o755)  # user mode: runs of other uids reach their folders in it
    tools, shared = base / "tools", base / "shared"
    tools.mkdir(mode=0o755)
    shared.mkdir()
    shared.chmod(0o777)  # both runs leave notes here (keys' ids), whatever uid they are
    setuid_id = tools / "id"
    shutil.copy("/usr/bin/id", setuid_id)
    setuid_id.chmod(0o4755)  # setuid to its owner, root where the test is root: prints 0 where setuid works
    host_name = f"stepmill-host-secret-{marker}"
    host_key = add_host_key(host_name, f"HOST-SECRET-{marker}".encode())
    env = {"GRAB_HOST_KEY": str(host_key), "GRAB_HOST_KEY_NAME": host_name, "GRAB_SETUID": str(setuid_id),
           "GRAB_SHARED": str(shared), "GRAB_RECIPE": "from-the-recipe", "GRAB_FORKS": "40"}
    expose = f'["{tools}", {{ path = "{shared}", writable = true }}]'
    folder = tmp_path_factory.mktemp("grab")
    config = write_rollout(folder, proxy, dataset=f"grab-{marker}", command=[SYSTEM_PYTHON, str(GRAB)], env=env,
                           tasks=[{"id": f"t0{i}", "prompt": f"grab {i}", "answer": "0"} for i in (1, 2)],
                           isolation=f'mode = "{mode}"\nexpose = {expose}\nlimits = {{ pids = 48 }}',
                           run=f'concurrency = 2\nruns_dir = "{base / "runs"}"')
    runner_env = {**os.environ, **RUNNER_SECRETS, "GRAB_PASSED": "passed-on"}
    try:
        done = subprocess.run(STEPMILL + ["rollout", str(config), "--no-progress"], capture_output=True, text=True,
                              timeout=300, env=runner_env)
        after = {"core_pattern": Path("/proc/sys/kernel/core_pattern").read_text(), "hostname": socket.gethostname(),
                 "port_start": PORT_START.read_text(),
                 # who the runs are on the host: the owners of the files each left in the shared folder
                 "owners": {name: (shared / name).stat().st_uid for name in ("keys.json", "read.done")
                            if (shared / name).exists()}}
        logs = {}
        for row in proxy.store().query("SELECT id, metadata FROM trajectories WHERE id LIKE ?", [f"grab-{marker}-%"]):
            metadata = json.loads(row["metadata"])
            logs[row["id"]] = Path(metadata.get("log") or Path(metadata["workdir"], "agent.log")).read_text(
                errors="replace")
    finally:  # what a run changed of the host (where it could) is put back before anything reads it
        if Path("/proc/sys/kernel/core_pattern").read_text() != before["core_pattern"] and os.geteuid() == 0:
            Path("/proc/sys/kernel/core_pattern").write_text(before["core_pattern"])
        if socket.gethostname() != before["hostname"] and os.geteuid() == 0:
            socket.sethostname(before["hostname"])
        if PORT_START.read_text() != before["port_start"] and os.geteuid() == 0:
            PORT_START.write_text(before["port_start"])
        revoke_key(host_key)
        shutil.rmtree(base, ignore_errors=True)
    store = proxy.store()
    rows = {r["id"]: json.loads(r["metadata"]) for r in
            store.query("SELECT id, metadata FROM trajectories WHERE id LIKE ?", [f"grab-{marker}-%"])}
    reports = {}
    for trajectory, metadata in rows.items():
        log = logs[trajectory]
        lines = [json.loads(line[len(REPORT):]) for line in log.splitlines() if line.startswith(REPORT)]
        assert lines, f"{trajectory} printed no report:\n{log[-3000:]}\n{done.stderr[-2000:]}"
        reports[lines[-1]["role"]] = lines[-1]
    assert set(reports) == {"keeper", "reader"}, (done.stderr[-3000:], rows)
    return {"mode": mode, "reports": reports, "rows": rows, "before": before, "after": after, "done": done}


def _refused(attempt: dict, why: str) -> None:
    assert not attempt["ok"], f"{why}: the attempt succeeded: {attempt}"


def test_a_sandboxed_run_is_never_root_on_the_host(grabbed):
    owners = grabbed["after"]["owners"]
    assert set(owners) == {"keys.json", "read.done"}, owners
    for name, uid in owners.items():
        assert uid != 0, f"the run that wrote {name} is uid {uid} on the host (root)"
    for role, report in grabbed["reports"].items():
        seen = report["identity"]["value"]
        assert seen["uid"] == seen["euid"] != 0, f"{role}: {seen}"
        if grabbed["mode"] == "sandbox":  # a user namespace of its own, mapping its uid alone
            assert seen["uid_map"][2] == "1", f"{role}: {seen}"
        assert int(seen["cap_eff"], 16) == 0, f"{role}: the run holds capabilities {seen['cap_eff']}"


def test_kernel_core_pattern_cannot_be_written(grabbed):
    for role, report in grabbed["reports"].items():
        _refused(report["core_pattern"], f"{role}: kernel.core_pattern was written (a program of the run's "
                                         f"choosing would run as root on the host)")
        assert report["core_pattern"]["error"] in ("OSError", "PermissionError"), report["core_pattern"]
    assert grabbed["after"]["core_pattern"] == grabbed["before"]["core_pattern"], "the host's core_pattern changed"
    assert grabbed["after"]["port_start"] == grabbed["before"]["port_start"], (
        "the host's ip_unprivileged_port_start changed (only a run's own network's may)")


def test_the_hostname_cannot_change_and_a_run_has_its_own(grabbed):
    for role, report in grabbed["reports"].items():
        _refused(report["hostname_sysctl"], f"{role}: kernel.hostname was written")
        _refused(report["sethostname"], f"{role}: sethostname worked")
        assert grabbed["mode"] != "sandbox" or report["identity"]["value"]["hostname"] == "stepmill-run", (
            f"{role}: the run shares the host's UTS namespace: {report['identity']}")
    assert grabbed["after"]["hostname"] == grabbed["before"]["hostname"], "the host's name changed"


def test_no_key_of_the_host_root_is_reachable(grabbed):
    for role, report in grabbed["reports"].items():
        _refused(report["host_key_read"], f"{role}: read the key the host's root keeps in its user keyring")
        for ring in ("session", "user"):
            _refused(report[f"host_key_search_{ring}"], f"{role}: found the host root's key from its {ring} keyring")


def test_no_run_reads_another_runs_keys(grabbed):
    keeper, reader = grabbed["reports"]["keeper"], grabbed["reports"]["reader"]
    made = keeper["own_keys"]
    assert all(got["ok"] for got in made.values()), f"the keeper could not add its keys: {made}"
    assert keeper["own_key_read"]["session"] == {"ok": True, "value": "RUN-SECRET-session"}  # its own: readable
    for ring, got in reader["other_run_key_read"].items():
        _refused(got, f"the reader read the keeper's {ring}-keyring key by its id")
    for ring, got in reader["other_run_key_search"].items():
        _refused(got, f"the reader found the keeper's key in its own {ring} keyring (the two share it)")


def test_a_setuid_root_binary_gives_no_root(grabbed):
    if os.geteuid() != 0:
        pytest.skip("only root can make a setuid-root binary for a run to try")
    for role, report in grabbed["reports"].items():
        got = report["setuid_id"]
        assert got["ok"] and got["value"] not in ("", "0"), f"{role}: a setuid-root binary ran as uid {got}"


def test_each_runs_process_count_is_its_own(grabbed):
    for role, report in grabbed["reports"].items():
        forks = report["forks"]
        assert forks["started"] == 40 and forks["error"] is None, (
            f"{role}: 40 processes under a limit of 48 per run, and it got {forks}: the count is shared")


def test_the_runners_api_keys_are_not_in_the_runs_environment(grabbed):
    for role, report in grabbed["reports"].items():
        seen = report["environment"]
        for name in RUNNER_SECRETS:
            assert seen[name] is None, f"{role}: the runner's {name} is in the run's environment"
        assert seen["GRAB_PASSED"] is None  # not named by [isolation] pass_env
        assert seen["GRAB_RECIPE"] == "from-the-recipe" and seen["PATH"], seen
