"""Processes of a fleet for the tests: a node's `stepmill serve`, and trainers (`RemoteConsumer` in a
process of its own) that log what they claim and acknowledge."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

from stepmill.children import free_port

from .conftest import STEPMILL, wait_until


def start_serve(node_id: str, db, confdir, url: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    """`stepmill serve` of one node's file, publishing to the coordinator at ``url``; (process, its URL)."""
    port = free_port()
    log = tmp / f"serve-{node_id}.log"
    process = subprocess.Popen(STEPMILL + ["serve", "--db", str(db), "--port", str(port), "--confdir",
                                           str(confdir), "--node-id", node_id, "--coordinator", url,
                                           "--heartbeat", "0.3"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    serve_url = f"http://127.0.0.1:{port}"

    def up():
        assert process.poll() is None, log.read_text()
        try:
            return urllib.request.urlopen(serve_url + "/v1/health", timeout=2).status == 200
        except OSError:
            return False

    wait_until(up, timeout=60, what=f"stepmill serve of {node_id}")
    return process, serve_url


# A trainer process: claims through the coordinator, fetches from the nodes, holds each batch ``hold`` s,
# acknowledges, and writes one JSON line per event; it stops once ``expect`` groups are acknowledged
# fleet-wide. ``die_holding``: claim one group, say so, and wait to be killed.
CONSUMER = r"""
import json, sys, time
from stepmill.errors import Conflict
from stepmill.store.fleet_ledger import Coordinator
from stepmill.fleet.remote_consumer import RemoteConsumer

url, name, tokens, out, hold, lease, expect, die = sys.argv[1:9]
fleet = Coordinator(url)
trainer = RemoteConsumer(fleet, name, tokens=json.loads(tokens), lease_seconds=float(lease), retry_after_s=1)
with open(out, "a") as log:
    def say(**event):
        log.write(json.dumps({"consumer": name, **event}) + "\n")
        log.flush()
    deadline = time.time() + 90
    while time.time() < deadline:
        batch = trainer.claim()
        if batch is None:
            if fleet.counts()["acked"] >= int(expect):
                break
            time.sleep(0.1)
            continue
        group = batch.meta["group_id"]
        say(event="claimed", group=group, rows=len(batch), nodes=batch.meta["nodes"],
            trajectories=sorted(set(batch.meta.get("trajectory_id", []))))
        if die == "1":
            time.sleep(3600)
        time.sleep(float(hold))
        try:
            trainer.ack(batch)
            say(event="acked", group=group, rows=len(batch))
        except Conflict as exc:
            say(event="conflict", group=group, error=str(exc))
    say(event="done", report=dict(trainer.report), failures=trainer.failures)
"""


def start_consumer(url: str, name: str, tokens: dict, out: Path, *, hold: float = 0.05, lease: float = 5,
                   expect: int = 0, die: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CONSUMER, url, name, json.dumps(tokens), str(out), str(hold),
                             str(lease), str(expect), "1" if die else "0"],
                            stderr=(out.parent / f"{name}.err").open("wb"))


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def acks_by_group(fleet, groups) -> Counter:
    """How many leases of each group ended acknowledged, by the coordinator's history."""
    return Counter({g: sum(lease["ended"] == "acked" for lease in fleet.history(g)) for g in groups})
