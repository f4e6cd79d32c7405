"""`stepmill proxy`'s own master and command line: what a user passes through still works, and the
writer runs at the priority asked for."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepmill.children import free_port
from stepmill.cli.proxy_args import take_own_options

from .conftest import STEPMILL, answers, http_json, wait_until

ADD_LOG_SCRIPT = """
from pathlib import Path

class Collect:
    def add_log(self, entry):
        with open(Path(__file__).with_suffix(".log"), "a") as out:
            out.write(f"{entry.level} {entry.msg}\\n")

    def update(self, flows):
        with open(Path(__file__).with_suffix(".updates"), "a") as out:
            out.write("".join(f"{flow.request.path}\\n" for flow in flows))

addons = [Collect()]
"""


def test_own_options_are_taken_in_every_spelling():
    rest, own = take_own_options(["--listen-port", "9000", "--listen-host=0.0.0.0", "-s", "x.py",
                                  "--set", "confdir=/c", "--set=stepmill_db=/d.db", "--set", "flow_detail=2"])
    assert own == {"port": "9000", "host": "0.0.0.0", "confdir": "/c", "db": "/d.db"}
    assert rest == ["-s", "x.py", "--set", "flow_detail=2"]
    assert take_own_options(["-p", "81"]) == ([], {"port": "81"})
    assert take_own_options(["--listen-port=82"]) == ([], {"port": "82"})


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int, Path]:
    port, log = free_port(), tmp_path / "proxy.log"
    process = subprocess.Popen(STEPMILL + ["proxy", "--db", str(tmp_path / "steps.db"), "--confdir",
                                           str(tmp_path / "mitm"), *[a.replace("PORT", str(port)) for a in args]],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return process, port, log


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()


def writer_of(process: subprocess.Popen) -> int:
    """A writer process of the proxy: its child, or with workers its grandchild."""
    def parents() -> dict[int, tuple[int, bytes]]:
        found = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    found[int(entry)] = (int(stat[1]), Path(f"/proc/{entry}/cmdline").read_bytes())
                except OSError:
                    continue
        return found

    def find():
        table = parents()
        for pid, (parent, cmdline) in table.items():
            if b"stepmill.pipeline.writer" in cmdline and process.pid in (parent, table.get(parent, (None,))[0]):
                return pid
        return None
    return wait_until(find, timeout=30, what="the writer process")


def test_option_reads_under_the_lean_master_copy_what_can_change_and_nothing_else(monkeypatch):
    """The master's option reads skip deepcopy only where it gives the value itself (immutable values):
    a list read is still a copy, so changing it changes no option."""
    from mitmproxy import http, optmanager, options

    from stepmill import proxy_master

    # the patches last only for this test (the proxy process applies them for its life)
    monkeypatch.setattr(optmanager._Option, "current", optmanager._Option.current)
    monkeypatch.setattr(http.MessageData, "__post_init__", http.MessageData.__post_init__)
    proxy_master._lean_mitmproxy()
    assert optmanager._Option.current is proxy_master._current
    opts = options.Options()
    read = opts.ignore_hosts
    read.append("example.com")
    assert opts.ignore_hosts == []
    opts.update(ignore_hosts=["a"], listen_port=8123, mode=["regular"])
    read = opts.ignore_hosts
    read.append("b")
    assert opts.ignore_hosts == ["a"] and opts.listen_port == 8123 and opts.mode == ["regular"]
    assert opts.listen_host == "" and opts.ssl_insecure is False
    request = http.Request.make("POST", "http://h/v1/chat/completions", b"{}")  # built without the debug check
    assert request.host == "h" and request.content == b"{}"


def test_mitmdump_flags_and_add_log_hooks_pass_through(tmp_path):
    """`--listen-port` (mitmdump's spelling) is the port listened on, and a user's script with the
    deprecated add_log hook still gets log entries, with an update hook the flows' updates (stepmill only
    skips them while nobody listens)."""
    script = tmp_path / "collect.py"
    script.write_text(ADD_LOG_SCRIPT)
    process, port, log = start(tmp_path, "--listen-port", "PORT", "-s", str(script))
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/_stepmill/v1/health") or process.poll() is not None,
                   timeout=60, what="proxy start")
        assert process.poll() is None, log.read_text()
        status, _ = http_json("GET", "http://stepmill.local/v1/health", proxy=f"http://127.0.0.1:{port}")
        assert status == 200
        entries = tmp_path / "collect.log"
        wait_until(lambda: entries.exists() and "client connect" in entries.read_text(), what="add_log entries")
        updates = tmp_path / "collect.updates"
        wait_until(lambda: updates.exists() and "/v1/health" in updates.read_text(), what="update events")
    finally:
        stop(process)


@pytest.mark.parametrize("priority", ["idle", "low", "normal"])
def test_writer_priority(tmp_path, priority):
    process, port, log = start(tmp_path, "--port", "PORT", "--set", f"stepmill_writer_priority={priority}")
    try:
        writer = writer_of(process)
        expected = {"idle": os.SCHED_IDLE, "low": os.SCHED_OTHER, "normal": os.SCHED_OTHER}[priority]
        base = os.getpriority(os.PRIO_PROCESS, process.pid)  # the proxy's own
        nice = base if priority == "normal" else min(19, base + 10)  # the writer lowers itself by 10
        wait_until(lambda: (os.sched_getscheduler(writer), os.getpriority(os.PRIO_PROCESS, writer)) == (expected, nice),
                   what=f"{priority} scheduling policy")
        time.sleep(0.5)  # and it stays so
        assert (os.sched_getscheduler(writer), os.getpriority(os.PRIO_PROCESS, writer)) == (expected, nice)
        from stepmill.client import StepmillClient

        health = StepmillClient(proxy=f"http://127.0.0.1:{port}", confdir=str(tmp_path / "mitm")).health()
        assert health["capture"]["writer_priority"] == priority
    finally:
        stop(process)


def test_an_unknown_writer_priority_is_refused(tmp_path):
    process, port, log = start(tmp_path, "--port", "PORT", "--set", "stepmill_writer_priority=fast")
    try:
        process.wait(60)
    finally:
        stop(process)
    assert process.returncode != 0
    assert "stepmill_writer_priority must be one of idle, low, normal, not 'fast'" in log.read_text()


def test_idle_writer_leaves_idle_priority_for_its_transactions_where_permitted():
    """The write lock is never held at idle priority by a process that may leave it."""
    code = """
import os, resource
from stepmill.pipeline.writer import Priority
p = Priority("idle")
p.apply()
assert os.sched_getscheduler(0) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, 0) == 10
with p.raised():
    inside = os.sched_getscheduler(0)
after = os.sched_getscheduler(0)
print(inside == os.SCHED_OTHER, after == os.SCHED_IDLE, p.idle)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    permitted = os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 10
    # Permitted: out of SCHED_IDLE inside, back after. Not: idle throughout, and it stops trying.
    assert out == (["True", "True", "True"] if permitted else ["False", "True", "False"])


def test_a_misspelt_choice_is_an_error(tmp_path):
    """Options with choices are checked the mitmproxy way (OptionsError in configure), not read as a default."""
    done = subprocess.run(STEPMILL + ["proxy", "--db", str(tmp_path / "s.db"), "--confdir", str(tmp_path / "m"),
                                      "--port", str(free_port()), "--set", "stepmill_writer=thred"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0 and "stepmill_writer must be one of process, thread, not 'thred'" in done.stderr
