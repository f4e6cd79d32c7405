"""A sandboxed run's door opens onto its LLM and [isolation] allow_hosts (host and port) alone, judged by
where the connection really goes: a real run (tests/adversary/door_reach.py, under `stepmill rollout`,
bubblewrap, a network of its own) tries a POST on an LLM path, a POST on an LLM-looking path under
another prefix, a WebSocket upgrade and a CONNECT to listeners this test keeps on the host's loopback,
on [::1] and in a network namespace it makes itself (a veth pair, nothing leaves the machine), and a
request whose Host header names an allowed host while its URL names a listener. Each is refused with
the reason before anything is connected: no listener sees a connection (no probe either), no step
is stored, and a CONNECT is answered alike whether anything listens or not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stepmill.children import free_port
from stepmill.runner import isolation as iso
from stepmill.store import Store

from .sandboxing import need_sandbox
from .conftest import wait_until
from .test_adversarial import TASKS, black_box, run_rollout, start_stack, stop_stack

LISTENER = r'''
import socket, sys, threading
host, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
server = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
print("LISTENING", flush=True)
def serve(conn):
    with conn:
        print("CONNECTION", flush=True)
        conn.settimeout(5)
        try:
            conn.recv(65536)
        except OSError:
            pass
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(secret), secret))
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
'''


class Listener:
    """A host process answering anything with its secret, and saying on its log each connection it got."""

    def __init__(self, host: str, port: int, secret: str, log: Path, prefix: list[str] = ()):
        self.target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.log = log
        self.process = subprocess.Popen([*prefix, sys.executable, "-c", LISTENER, host, str(port), secret],
                                        stdout=log.open("wb"), stderr=subprocess.STDOUT)
        wait_until(lambda: "LISTENING" in log.read_text() or self.process.poll() is not None, what=f"{self.target}")
        assert self.process.poll() is None, log.read_text()

    def connections(self) -> int:
        return self.log.read_text().count("CONNECTION")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


class Namespace:
    """A network namespace of the test's own, reached from the host over a veth pair (10.211.N.0/30)."""

    def __init__(self, marker: str):
        tail = marker[-6:]
        self.name, self.outer, self.inner = f"smdoor-{tail}", f"vh-{tail}", f"vn-{tail}"
        self.subnet = int(marker[-2:], 16)
        self.address = f"10.211.{self.subnet}.2"
        steps = [["ip", "netns", "add", self.name],
                 ["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
                 ["ip", "link", "set", self.inner, "netns", self.name],
                 ["ip", "addr", "add", f"10.211.{self.subnet}.1/30", "dev", self.outer],
                 ["ip", "link", "set", self.outer, "up"],
                 ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.address}/30", "dev", self.inner],
                 ["ip", "netns", "exec", self.name, "ip", "link", "set", self.inner, "up"],
                 ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                self.remove()
                pytest.skip(f"a network namespace cannot be made here ({' '.join(step)}: {done.stderr.strip()})")

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, check=False)


def sandbox_stack(simulated_llm, tmp_path_factory, name: str):
    """A proxy, Datasette and database for sandboxed runs (skipped where bubblewrap cannot run)."""
    need_sandbox()
    return start_stack("sandbox", tmp_path_factory.mktemp(name), simulated_llm.url)


@pytest.fixture(scope="module")
def reached(simulated_llm, tmp_path_factory):
    """The listeners, and the run's report once its rollout ended."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("the network namespace this test makes needs root and ip(8)")
    stack = sandbox_stack(simulated_llm, tmp_path_factory, "door-reach")
    logs = stack.logs
    marker = stack.marker
    namespace = Namespace(marker)
    listeners = {}
    try:
        secret = f"SECRET-{marker}"
        listeners["loopback"] = Listener("127.0.0.1", free_port(), secret, logs / "loopback.log")
        listeners["ipv6"] = Listener("::1", free_port(), secret, logs / "ipv6.log")
        listeners["netns"] = Listener(namespace.address, 8080, secret, logs / "netns.log",
                                      prefix=["ip", "netns", "exec", namespace.name])
        allowed = Listener("127.0.0.1", free_port(), f"ALLOWED-{marker}", logs / "allowed.log")
        targets = {name: listener.target for name, listener in listeners.items()}
        targets["closed"] = f"127.0.0.1:{free_port()}"
        env = {"INSIDER_MARKER": marker, "DOOR_TARGETS": json.dumps(targets),
               "DOOR_SPOOF": listeners["loopback"].target, "DOOR_ALLOWED": allowed.target,
               "DOOR_ALLOWED_NAME": "allowed.example"}
        env_toml = "{ " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in env.items()) + " }"
        rollout = run_rollout(stack, "reach", agents=black_box("reach", "door_reach.py", env_toml),
                              run_agents=["reach"], tasks=TASKS[:1], concurrency=1,
                              isolation_extra=f'allow_hosts = ["allowed.example", "{allowed.target}"]')
    finally:
        stop_stack(stack)
        for listener in [*listeners.values(), *([allowed] if "allowed" in locals() else [])]:
            listener.stop()
        namespace.remove()
    yield stack, rollout, listeners, allowed, targets
    shutil.rmtree(stack.base, ignore_errors=True)  # the runs' folders too: beside its database


def _refused(got: dict, what: str) -> dict:
    assert got["ok"], f"{what}: {got}"
    value = got["value"]
    assert "SECRET-" not in json.dumps(value), f"{what}: the run reached a host that is not its LLM's: {value}"
    return value


def _refused_http(got: dict, what: str) -> None:
    value = _refused(got, what)
    assert value["status"] == 403, f"{what}: not refused: {value}"
    error = value["body"]["error"]
    assert error["type"] == "stepmill_refused" and "reaches only its LLM through the proxy" in error["message"], value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_reaches_no_host_but_its_llms_and_allow_hosts_by_any_method(reached):
    stack, rollout, listeners, allowed, targets = reached
    assert rollout.done.returncode == 0, rollout.done.stderr
    attempts = rollout.report(f"{rollout.dataset}-t01-0")["attempts"]
    for name in ("loopback", "ipv6", "netns", "closed"):
        for kind in ("post", "prefixed", "websocket"):
            _refused_http(attempts[f"{kind}:{name}"], f"{kind} to {name} ({targets[name]})")
    for name, listener in listeners.items():  # nothing was connected there: no call, no engine probe
        assert listener.connections() == 0, f"the {name} listener got {listener.connections()} connection(s)"
    run = f"{rollout.dataset}-t01-0"
    store = Store(str(stack.db))
    try:
        stored = store.query("SELECT trajectory_id, channel, error, host, path FROM steps WHERE CAST(raw_request AS"
                             " TEXT) LIKE ? OR messages_suffix LIKE ?", [f"%DOOR-REACH-{stack.marker}%"] * 2)
        own = store.query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?", [run])[0]["n"]
    finally:
        store.close()
    assert own == 1, f"the run has {own} steps: its honest call alone was its own"
    for step in stored:  # kept as refused, with the reason: never the run's step
        assert step["trajectory_id"] != run and step["channel"] == "refused", f"stored as the run's: {step}"
        assert "reaches only its LLM through the proxy" in step["error"] and repr(run) in step["error"], step["error"]
    posted = sorted(f"{step['error']} {step['path']}" for step in stored)  # the error names host and port
    assert len(posted) == len(set(posted)) and len(posted) >= len(targets), posted  # each refused POST once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_connect_is_refused_alike_whether_anything_listens(reached):
    """No port scanner: the answer to a CONNECT to a host not allowed is the same for an open port
    and a closed one (the target named in it aside), and nothing is connected."""
    stack, rollout, listeners, allowed, targets = reached
    attempts = rollout.report(f"{rollout.dataset}-t01-0")["attempts"]
    answers = {}
    for name in ("loopback", "ipv6", "netns", "closed"):
        value = _refused(attempts[f"connect:{name}"], f"CONNECT to {name}")
        assert value["status"].startswith("HTTP/1.1 403"), f"CONNECT to {name} ({targets[name]}) was not refused: {value}"
        answers[name] = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+|::1:\d+|\[::1\]:\d+", "TARGET", value["body"])
    assert answers["loopback"] == answers["closed"] == answers["ipv6"] == answers["netns"], answers


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_header_naming_an_allowed_host_sends_nothing_elsewhere(reached):
    """allow_hosts names a host (and a port): a request whose Host header names it while its URL names
    a listener goes nowhere; the allowed host:port itself is reached, another port of its host is not."""
    stack, rollout, listeners, allowed, targets = reached
    attempts = rollout.report(f"{rollout.dataset}-t01-0")["attempts"]
    _refused_http(attempts["host_spoof"], "Host: allowed.example to the loopback listener")
    _refused_http(attempts["allowed_other_port"], "another port than allow_hosts names")
    got = attempts["allowed"]
    assert got["ok"] and got["value"]["status"] == 200 and got["value"]["body"] == f"ALLOWED-{stack.marker}", got
    assert allowed.connections() == 1


@pytest.mark.timeout(120)
def test_a_rewrite_is_judged_by_where_the_connection_then_goes(upstream, tmp_path):
    """A request to the run's allowed host that a proxy setting (mitmproxy's map_remote) sends to another
    host is refused there, nothing connected: the check reads where the connection goes after any rewrite.
    (A host process stands in for the runner's side of the door: it holds the door key, as only the
    runner does.)"""
    import hashlib
    import http.client

    from .conftest import launch_proxy, stop_proxy

    allowed, elsewhere = free_port(), Listener("127.0.0.1", free_port(), "SECRET-rewritten",
                                               tmp_path / "elsewhere.log")
    proxy = launch_proxy(tmp_path / "proxy", "http://127.0.0.1:9", "--set",
                         f"map_remote=|//127.0.0.1:{allowed}/|//{elsewhere.target}/", upstream=upstream)
    try:
        client = proxy.client()
        client.start_trajectory(trajectory_id="rewritten", group_id="rewritten")
        client.register_run("rewritten", door=hashlib.sha256(b"the door key").hexdigest(),
                            hosts=[f"127.0.0.1:{allowed}"])
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=15)
        conn.request("GET", f"http://127.0.0.1:{allowed}/anything", headers={"X-Stepmill-Door": "the door key"})
        answer = conn.getresponse()
        body = answer.read().decode()
        conn.close()
    finally:
        stop_proxy(proxy)
        elsewhere.stop()
    assert answer.status == 403 and "reaches only its LLM" in body and elsewhere.target in body, body
    assert elsewhere.connections() == 0
