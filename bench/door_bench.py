"""What a sandboxed run's door costs per call: the same client, the same proxy, the same upstream,
once on the host's loopback and once inside a run's own network namespace (``bwrap --unshare-net``),
its calls carried by ``door_inside.py`` and the runner's ``Doors`` (two more hops, a unix socket
between). Rounds interleave the two, so machine noise hits both alike; each round is N sequential
chat completions on one keep-alive connection, plain http, through ``stepmill proxy`` (one worker) to
the lean upstream, as in the shared proxy benchmark's ``ns`` workload at concurrency 1.

    .venv/bin/python -m bench.door_bench [--rounds 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lean_upstream import start_lean_upstream
from stepmill.auth.secret_hashes import secret_hash
from stepmill.auth.write_token import ensure_token
from stepmill.children import free_port
from stepmill.client import StepmillClient
from stepmill.runner import isolation as iso
from stepmill.runner.isolation.sandbox import sandbox_command
from stepmill.runner.door import Doors, Way, new_key

RUN_UID = 62999  # the uid the sandboxed client runs as when the bench runs as root

CLIENT = r'''
import base64, http.client, json, sys, time
host, port, n, auth, upstream = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}]}).encode()
headers = {"Content-Type": "application/json", "Proxy-Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
conn = http.client.HTTPConnection(host, port)
times = []
for _ in range(n):
    start = time.perf_counter()
    conn.request("POST", upstream + "/v1/chat/completions", body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status
    times.append(time.perf_counter() - start)
print(json.dumps(times))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    problem = iso.bwrap_problem()
    if problem:
        raise SystemExit(f"the sandbox cannot run here: {problem}")
    work = Path(tempfile.mkdtemp(prefix="stepmill-door-bench-"))
    upstream, _, http_port, _ = start_lean_upstream(work)
    port = free_port()
    confdir = work / "mitm"
    ensure_token(str(confdir))  # the proxy and this client share it from the start
    proxy = subprocess.Popen([str(Path(sys.executable).parent / "stepmill"), "proxy", "--workers", "1", "--host",
                              "127.0.0.1", "--port", str(port), "--db", str(work / "bench.db"), "--confdir",
                              str(confdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doors = Doors()
    try:
        client = StepmillClient(proxy=f"http://127.0.0.1:{port}", confdir=str(confdir), timeout=30)
        deadline = time.time() + 60
        while True:
            try:
                client.health()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        door_key = new_key()
        client.start_trajectory(trajectory_id="door-bench", group_id="door-bench")
        secret = client.register_run("door-bench", door=secret_hash(door_key),
                                     hosts=[f"127.0.0.1:{http_port}"])["secret"]
        auth, target = f"door-bench:{secret}", f"http://127.0.0.1:{http_port}"
        run_dir = work / "run"
        (run_dir / "work").mkdir(parents=True)
        door, folder = doors.open("bench", door_key, [Way(port, "127.0.0.1", port)])
        uid = RUN_UID if os.geteuid() == 0 else None  # a root runner's run becomes another uid, as in a rollout
        if uid is not None:
            for path in (run_dir, run_dir / "work", folder):
                os.chown(path, uid, uid)
        outside = [sys.executable, "-I", "-c", CLIENT, "127.0.0.1", str(port), str(args.calls), auth, target]
        inside = sandbox_command(outside, run_dir=run_dir, private=iso.Private([], []), door=door, needs=[folder],
                                 uid=uid)
        times: dict[str, list[float]] = {"host loopback": [], "sandbox door": []}
        for _ in range(args.rounds):
            for name, command in (("host loopback", outside), ("sandbox door", inside)):
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"the {name} client failed ({done.returncode}): {done.stderr[-2000:]}")
                times[name] += json.loads(done.stdout.strip().splitlines()[-1])[10:]  # a warm connection
        print(f"{args.rounds} rounds x {args.calls} sequential calls, plain http, keep-alive, "
              f"stepmill proxy (1 worker) -> lean upstream\n")
        print("| client | p50 ms | mean ms | p99 ms |\n| --- | --- | --- | --- |")
        for name, values in times.items():
            values.sort()
            print(f"| {name} | {statistics.median(values) * 1e3:.3f} | {statistics.fmean(values) * 1e3:.3f} | "
                  f"{values[int(len(values) * 0.99)] * 1e3:.3f} |")
        cost = statistics.median(times["sandbox door"]) - statistics.median(times["host loopback"])
        print(f"\nthe door's cost per call (p50 difference): {cost * 1e3:.3f} ms")
    finally:
        doors.stop()
        for process in (proxy, upstream):
            process.terminate()
            process.wait(20)


if __name__ == "__main__":
    main()
