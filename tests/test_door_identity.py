"""A sandboxed run's identity cannot be borrowed: the proxy knows the run by the door key the runner's
side of its door adds, which neither the run nor any other process of the host holds. While a real
sandboxed run is open, a host process binds the address a door would have had (what the run's
registration holds, when that is an address), 127.0.0.1 and another loopback address, and calls the
proxy as the run would: without credentials, and with the run's registered door value as its key.
It gets nothing of the run's (every call refused, nothing written), and the refusal is the same
whatever address it came from. Given the run's own secret (read off the run's environment), it is
refused just the same: the secret admits nothing that did not come through the run's door.
"""

from __future__ import annotations

import ipaddress
import json
import random
import shutil
import subprocess
import sys
import threading

import pytest

from stepmill.store import Store

from .conftest import wait_until
from .test_adversarial import MODEL, TASKS, black_box, run_rollout, stop_stack
from .test_door_reach import sandbox_stack

HOST_PROCESS = r'''
import base64, http.client, json, socket, sys
proxy_port, base, marker, door = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
addresses, secret = json.loads(sys.argv[5]), sys.argv[7]
lent = {"Proxy-Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}
body = json.dumps({"model": sys.argv[6], "messages": [{"role": "user", "content": f"BORROWED-{marker}"}]})
out = {}
for address in addresses:
    for how, given in (("plain", {}), ("keyed", {"X-Stepmill-Door": door}), ("secret", lent)):
        conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=15, source_address=(address, 0))
        conn.request("POST", base + "/chat/completions", body=body,
                     headers={"Content-Type": "application/json", **given})
        response = conn.getresponse()
        out[f"{address} {how}"] = {"status": response.status,
                                                             "body": response.read().decode("utf-8", "replace")}
        conn.close()
print(json.dumps(out))
'''


def _lent_secret(trajectory: str) -> str:
    """The run's own proxy credentials (user:secret), as a host process that reads the run's environment
    has them (this test is root: /proc/<pid>/environ of the run's agent)."""
    import urllib.parse
    from pathlib import Path

    def found():
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                text = environ.read_text(errors="replace")
                values = dict(item.split("=", 1) for item in text.split("\0") if "=" in item)
            except OSError:
                continue
            if values.get("STEPMILL_TRAJECTORY") == trajectory and values.get("HTTP_PROXY"):
                parts = urllib.parse.urlsplit(values["HTTP_PROXY"])
                return f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password)}"
        return None
    return wait_until(found, timeout=60, interval=0.2, what="the run's secret in its environment")


def _other_loopback() -> str:
    return f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_process_on_a_doors_address_gets_nothing_of_the_run(simulated_llm, tmp_path_factory):
    stack = sandbox_stack(simulated_llm, tmp_path_factory, "door-identity")
    marker, finished = stack.marker, []
    trajectory = f"borrow-{marker}-t01-0"
    rollout = threading.Thread(target=lambda: finished.append(run_rollout(
        stack, "borrow", agents=black_box("victim", "victim.py", '{ INSIDER_LINGER = "8", INSIDER_LINGER_ON = "t01" }'),
        run_agents=["victim"], tasks=TASKS[:1], concurrency=1)), daemon=True)
    try:
        rollout.start()
        store = Store(str(stack.db), readonly=True)
        try:
            registered = wait_until(lambda: store.query(
                "SELECT door FROM run_credentials WHERE trajectory_id = ? AND revoked_at IS NULL", [trajectory]),
                timeout=60, interval=0.2, what="the run's registration")
        finally:
            store.close()
        door = registered[-1]["door"]
        addresses = ["127.0.0.1", _other_loopback()]
        try:
            if ipaddress.ip_address(door).is_loopback:
                addresses.insert(0, door)  # a door known by its address: the one a scanner finds
        except ValueError:
            pass
        secret = _lent_secret(trajectory)
        done = subprocess.run([sys.executable, "-c", HOST_PROCESS, str(stack.port), simulated_llm.url, marker, door,
                               json.dumps(addresses), MODEL, secret],
                              capture_output=True, text=True, timeout=120, check=True)
        got = json.loads(done.stdout)
        rollout.join(200)
    finally:
        stop_stack(stack)
    [ran] = finished
    try:
        for attempt, answer in got.items():
            assert answer["status"] == 403, f"a host process was let through as the run ({attempt}): {answer}"
        for keyed in ("plain", "keyed", "secret"):  # the same refusal whatever the address
            bodies = {attempt: answer["body"] for attempt, answer in got.items() if attempt.endswith(keyed)}
            assert len(set(bodies.values())) == 1, bodies
        plain, lent = (got[f"127.0.0.1 {how}"]["body"] for how in ("plain", "secret"))
        assert lent == plain, f"the run's secret got another answer than an unknown caller's: {lent}"
        store = Store(str(stack.db))
        try:
            borrowed = [row for row in store.iter_steps() if f"BORROWED-{marker}" in json.dumps(row)]
            own = store.query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?", [trajectory])[0]["n"]
        finally:
            store.close()
        assert not borrowed, f"a host process wrote as the run: {borrowed[0]['trajectory_id']}"
        assert own == 1  # the run's own honest call alone
        assert ran.done.returncode == 0 and ran.trajectories[trajectory]["metadata"]["outcome"] == "ok", ran.done.stderr
    finally:
        shutil.rmtree(stack.base, ignore_errors=True)  # the runs' folders too: beside its database


KEYED_CALLS = r'''
import http.client, json, sys
port, key, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
out = []
for _ in range(12):  # new connections, spread over the workers
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    conn.request("POST", target + "/v1/chat/completions", body=b"{}", headers={"X-Stepmill-Door": key})
    response = conn.getresponse()
    out.append(json.loads(response.read())["error"]["message"])
    conn.close()
print(json.dumps(out))
'''


@pytest.mark.slow  # several proxy workers and runs: about a minute on 2 busy cores
@pytest.mark.timeout(120)
def test_every_worker_knows_a_run_by_its_door_key(upstream, tmp_path):
    """With several proxy workers each connection's door key is bound by whichever worker takes it: a run
    registered through one worker is known to all before its registration is answered. (A host process
    stands in for the runner's side of the door: it holds the key, as only the runner does.)"""
    import hashlib

    from .conftest import launch_proxy, stop_proxy

    proxy = launch_proxy(tmp_path, "http://127.0.0.1:9", "--workers", "2", upstream=upstream)
    try:
        client = proxy.client()
        client.start_trajectory(trajectory_id="keyed", group_id="keyed")
        client.register_run("keyed", door=hashlib.sha256(b"the door key").hexdigest(), hosts=["127.0.0.1:9"])
        for key, said in (("the door key", "run 'keyed' reaches only its LLM"), ("a guess", "no run's door holds")):
            done = subprocess.run([sys.executable, "-c", KEYED_CALLS, str(proxy.port), key, "http://127.0.0.1:10"],
                                  capture_output=True, text=True, timeout=60, check=True)
            messages = json.loads(done.stdout)
            assert all(said in message for message in messages), messages
    finally:
        stop_proxy(proxy)


ANSWERED_FIRST = r'''
import base64, http.client, json, sys
port, key, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
out = []
for headers in ({"X-Stepmill-Door": key},  # the door's first request: answered 407 by proxyauth, before the doors
                {"Proxy-Authorization": "Basic " + base64.b64encode(b"user:pass").decode()}):
    conn.request("POST", target + "/v1/chat/completions", body=b"{}", headers=headers)
    response = conn.getresponse()
    out.append([response.status, response.read().decode("utf-8", "replace")])
print(json.dumps(out))
'''


@pytest.mark.timeout(120)
def test_a_doors_connection_is_the_runs_even_when_another_addon_answered_its_first_request(upstream, tmp_path):
    """mitmproxy's proxyauth answers a request without proxy credentials (407) before stepmill's doors
    look at it. The door key on that first request still binds the connection: the next request on it,
    with credentials and no key, is the run's and reaches only the run's hosts. (A host process stands
    in for the runner's side of the door: it holds the key, as only the runner does.)"""
    import hashlib

    from .conftest import launch_proxy, stop_proxy

    from stepmill.client import StepmillClient

    proxy = launch_proxy(tmp_path, "http://127.0.0.1:9", "--set", "proxyauth=user:pass", upstream=upstream)
    try:
        client = StepmillClient(proxy=f"http://user:pass@127.0.0.1:{proxy.port}", confdir=str(proxy.confdir))
        client.start_trajectory(trajectory_id="answered", group_id="answered")
        client.register_run("answered", door=hashlib.sha256(b"the door key").hexdigest(), hosts=["127.0.0.1:9"])
        done = subprocess.run([sys.executable, "-c", ANSWERED_FIRST, str(proxy.port), "the door key",
                               "http://127.0.0.1:10"], capture_output=True, text=True, timeout=60, check=True)
        (first, first_body), (second, body) = json.loads(done.stdout)
        assert first == 407, first_body
        assert second == 403 and "run 'answered' reaches only its LLM" in body, \
            f"the connection was not bound to the run by its first request's door key: {second} {body}"
    finally:
        stop_proxy(proxy)
