"""The fleet's coordinator on a real PostgreSQL (started here, initdb in a temporary folder).

The faults are real: a consumer process killed with SIGKILL while it holds claims, PostgreSQL
restarted (``pg_ctl restart``) under consumer processes that claim and ack in a loop, two runner
processes registering into one coordinator at once, a node's heartbeat process killed.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.errors import BadInput, ConfigError, Conflict, NotFound, StoreUnavailable

from .conftest import wait_until


# Worker processes are forked: real processes (killed with SIGKILL where a test says so) that start at once,
# without importing stepmill again on a busy machine.
FORK = multiprocessing.get_context("fork")
# Python warns about fork when a process has any other thread; here those are native helper threads of
# libraries the suite loads (a BLAS pool, jemalloc's), which hold nothing a worker uses.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")





def ready(fleet, groups: list[str], *, node: str = "node-a", size: int = 2, channel: str = "train",
          version=None) -> list[str]:
    """Register the groups (``size`` runs each, on ``node``) and report every run finished, committed, scored."""
    fleet.register_node(node, f"http://{node}.example:8780")
    for group in groups:
        fleet.register_group(group, size, channel=channel)
        for i in range(size):
            fleet.register_run(f"{group}-r{i}", group_id=group, node_id=node)
            fleet.report(f"{group}-r{i}", finished=True, committed=True, scored=True, policy_version=version)
    return groups


def spawn(body, *args) -> multiprocessing.Process:
    """One of the process bodies below in a process of its own (its traceback, if any, on stderr)."""
    process = FORK.Process(target=body, args=args, daemon=True)
    process.start()
    return process


def finish(process: multiprocessing.Process, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError(f"a worker process did not finish in {timeout} s")
    assert process.exitcode == 0, f"a worker process failed (exit code {process.exitcode}): see its stderr"


def stop(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()


def written(path: Path, timeout: float = 30) -> str:
    """A file another process writes whole (renamed into place)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} was never written"
        time.sleep(0.02)
    return path.read_text()


def write(path: str, text: str) -> None:
    Path(path + ".part").write_text(text)
    os.replace(path + ".part", path)


# --- process bodies ---------------------------------------------------------------------------------------

def hold_claims(url: str, consumer: str, n: int, lease_s: float, out: str) -> None:
    """Claim and hold: write the claims down, then wait to be killed."""
    from stepmill.store.fleet_ledger import Coordinator

    claims = Coordinator(url).claim(consumer, n, lease_s)
    write(out, json.dumps([dataclasses.asdict(c) for c in claims]))
    time.sleep(600)


def consume(url: str, consumer: str, total: int, log: str) -> None:
    """Claim, work a moment, ack, until every group is acknowledged; each claim and ack logged as it happens."""
    from stepmill.store.fleet_ledger import Coordinator

    random.seed()  # forked: not the same pauses as the other consumers
    fleet = Coordinator(url, retry_s=30)
    deadline = time.monotonic() + 60
    with open(log, "a") as out:
        def note(*words):
            out.write(" ".join(map(str, words)) + "\n")
            out.flush()

        while time.monotonic() < deadline:
            claims = fleet.claim(consumer, 2, lease_seconds=3)
            for claim in claims:
                note("claim", claim.group_id, claim.lease_id)
            if not claims:
                if fleet.counts()["acked"] >= total:
                    note("reconnects", fleet.reconnects, 0)
                    return
                time.sleep(0.05)
                continue
            time.sleep(random.uniform(0.1, 0.25))
            for claim in claims:
                try:
                    fleet.ack(claim)
                except Conflict as exc:
                    note("refused", claim.group_id, claim.lease_id, str(exc).replace("\n", " "))
                else:
                    note("ack", claim.group_id, claim.lease_id)
    raise SystemExit("not every group was acknowledged within 60 s")


def run_runner(url: str, node: str, own: int, shared: int, go: Path, out: str) -> None:
    """A runner: its node, groups of its own, half of each shared group, and one run id both runners want."""
    from stepmill.store.fleet_ledger import Coordinator

    random.seed()
    fleet = Coordinator(url)
    while not go.exists():  # both start registering at the same moment
        time.sleep(0.005)
    fleet.register_node(node, f"http://{node}.example:8780")
    runs = []
    for g in range(own):
        fleet.register_group(f"{node}-g{g}", 3)
        for i in range(3):
            fleet.register_run(f"{node}-g{g}-r{i}", group_id=f"{node}-g{g}", node_id=node)
            runs.append(f"{node}-g{g}-r{i}")
    for g in range(shared):
        fleet.register_group(f"shared-g{g}", 4)  # both register it: the same group, once
        for i in range(2):
            fleet.register_run(f"shared-g{g}-{node}-r{i}", group_id=f"shared-g{g}", node_id=node)
            runs.append(f"shared-g{g}-{node}-r{i}")
    fleet.register_group("contested-g", 1)
    try:
        fleet.register_run("contested-run", group_id="contested-g", node_id=node)
        contested = "registered"
    except Conflict:
        contested = "conflict"
    random.shuffle(runs)
    for run in runs:
        fleet.report(run, finished=True)
        fleet.report(run, committed=True, scored=True)
    if contested == "registered":
        fleet.report("contested-run", finished=True, committed=True, scored=True)
    write(out, contested)


def heartbeat(url: str, node: str, period: float) -> None:
    """A node's heartbeat, until killed."""
    from stepmill.store.fleet_ledger import Coordinator

    fleet = Coordinator(url)
    fleet.register_node(node, f"http://{node}.example:8780")
    while True:
        fleet.heartbeat(node)
        time.sleep(period)


# --- the registry and readiness ------------------------------------------------------------------------------

def test_a_group_is_ready_when_all_its_runs_are_finished_committed_and_scored(fleet):
    fleet.register_node("node-a", "http://node-a:8780")
    fleet.register_group("g", 2)
    fleet.register_run("r0", group_id="g", node_id="node-a")
    assert fleet.report("r0", finished=True, committed=True, scored=True) is False  # one of two runs
    fleet.register_run("r1", group_id="g", node_id="node-a")
    assert fleet.report("r1", finished=True, committed=True) is False  # not scored yet
    assert fleet.claim("t", 5, 60) == []
    assert fleet.counts()["waiting"] == 1
    assert fleet.report("r1", scored=True) is True
    assert fleet.report("r1") is True  # flags, once set, stay set
    assert fleet.counts() == {"waiting": 0, "ready": 1, "leased": 0, "acked": 0, "stale": 0, "lost": 0}
    group = fleet.group("g")
    assert group["ready"] and group["state"] == "open" and set(group["runs"]) == {"r0", "r1"}


def test_ids_are_the_callers_and_one_run_lives_on_one_node(fleet):
    fleet.register_node("node-a", "http://node-a:8780")
    fleet.register_node("node-b", "http://node-b:8780")
    fleet.register_group("g", 2)
    fleet.register_group("g", 2)  # the same registration again: nothing changes
    fleet.register_run("r0", group_id="g", node_id="node-a")
    fleet.register_run("r0", group_id="g", node_id="node-a")  # idempotent (a runner resuming)
    with pytest.raises(Conflict, match="node-a"):
        fleet.register_run("r0", group_id="g", node_id="node-b")
    fleet.register_group("h", 1)
    with pytest.raises(Conflict):
        fleet.register_run("r0", group_id="h", node_id="node-a")
    with pytest.raises(Conflict, match="size|runs"):
        fleet.register_group("g", 3)
    with pytest.raises(Conflict):
        fleet.register_group("g", 2, channel="val")
    fleet.register_run("r1", group_id="g", node_id="node-b")
    with pytest.raises(Conflict, match="its 2 runs"):
        fleet.register_run("r2", group_id="g", node_id="node-a")
    with pytest.raises(NotFound):
        fleet.register_run("r9", group_id="nope", node_id="node-a")
    with pytest.raises(NotFound):
        fleet.register_run("r9", group_id="h", node_id="node-z")
    with pytest.raises(NotFound):
        fleet.report("r9", finished=True)
    with pytest.raises(NotFound):
        fleet.heartbeat("node-z")
    with pytest.raises(NotFound):
        fleet.group("nope")
    for bad in (lambda: fleet.register_group("", 2), lambda: fleet.register_group("x", 0),
                lambda: fleet.register_node("n", "ftp://x"), lambda: fleet.register_run("a\x00b", group_id="g",
                                                                                         node_id="node-a"),
                lambda: fleet.claim("t", 0, 60), lambda: fleet.claim("t", 1, -1), lambda: fleet.set_max_staleness(-1),
                lambda: fleet.set_policy_version(1.5)):
        with pytest.raises(BadInput):
            bad()
    fleet.register_node("node-a", "http://node-a.moved:8780")  # a node restarted elsewhere keeps its id
    assert {n["id"]: n["serve_url"] for n in fleet.nodes()}["node-a"] == "http://node-a.moved:8780"


def test_the_schema_is_created_once_and_a_newer_one_is_refused(url):
    import psycopg

    from stepmill.store.fleet_ledger import MIGRATIONS, Coordinator

    Coordinator(url).close()
    Coordinator(url).close()  # already there: only read
    with psycopg.connect(url, autocommit=True) as conn:
        versions = [row[0] for row in conn.execute("SELECT version FROM stepmill.schema_migrations")]
        assert versions == list(range(1, len(MIGRATIONS) + 1))
        conn.execute("INSERT INTO stepmill.schema_migrations (version, name) VALUES (99, 'future')")
    with pytest.raises(StoreUnavailable, match="upgrade stepmill"):
        Coordinator(url)


def test_the_url_comes_from_the_environment_and_its_password_is_never_shown(url, monkeypatch):
    from stepmill.store.fleet_ledger import ENV, Coordinator

    monkeypatch.setenv(ENV, url)
    with Coordinator() as fleet:
        assert fleet.counts()["ready"] == 0
    monkeypatch.delenv(ENV)
    with pytest.raises(ConfigError, match=ENV):
        Coordinator()
    with pytest.raises(BadInput) as bad:
        Coordinator("mysql://root:hunter2@db/x")
    assert "hunter2" not in str(bad.value)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as down:
        Coordinator("postgresql://u:hunter2@127.0.0.1:1/x?password=hunter2&sslmode=disable", retry_s=0.3)
    assert time.monotonic() - start < 10
    assert "hunter2" not in str(down.value) and "***" in str(down.value)
    assert down.value.__suppress_context__ and "hunter2" not in str(down.value.__context__)


@settings(max_examples=100, deadline=None)
@given(user=st.text(min_size=1, max_size=12), password=st.text(min_size=1, max_size=20),
       host=st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True), port=st.integers(1, 65535),
       database=st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True), in_query=st.booleans())
def test_a_redacted_url_keeps_everything_but_the_password(user, password, host, port, database, in_query):
    from stepmill.store.fleet_ledger import _scrubbed, redacted

    secret = quote(password, safe="")
    if in_query:
        url = f"postgresql://{quote(user, safe='')}@{host}:{port}/{database}?sslmode=disable&password={secret}"
    else:
        url = f"postgresql://{quote(user, safe='')}:{secret}@{host}:{port}/{database}?sslmode=disable"
    shown = redacted(url)
    others = f"postgresql://{quote(user, safe='')}@{host}:{port}/{database}?sslmode=disable&password=***"
    if secret not in others and password not in others:
        assert secret not in shown and password not in shown
    parts = urlsplit(shown)
    assert (parts.hostname, parts.port, parts.path) == (host, port, f"/{database}")
    assert parts.username == quote(user, safe="")
    assert "sslmode=disable" in parts.query
    assert password not in _scrubbed(f"auth failed for {password} / {secret}", url)


# --- claims, acks, leases -------------------------------------------------------------------------------------

def test_an_ack_takes_effect_once_and_a_late_one_is_refused(fleet):
    ready(fleet, ["g1", "g2"])
    first = fleet.claim("t0", 1, lease_seconds=1.5)
    assert [c.group_id for c in first] == ["g1"] and first[0].runs == {"g1-r0": "node-a", "g1-r1": "node-a"}
    assert first[0].nodes == {"node-a": "http://node-a.example:8780"}
    assert [c.group_id for c in fleet.claim("t1", 5, lease_seconds=60)] == ["g2"]  # g1 is held
    time.sleep(max(0.0, first[0].lease_until - time.time()) + 0.1)
    second = fleet.claim("t1", 5, lease_seconds=60)  # t0's lease ran out: g1 goes to t1
    assert [c.group_id for c in second] == ["g1"]
    with pytest.raises(Conflict, match="leased to 't1'"):
        fleet.ack(first[0])
    fleet.ack(second[0])
    fleet.ack(second[0])  # the holder acknowledging again: nothing more happens
    with pytest.raises(Conflict, match="acknowledged"):
        fleet.ack(first[0])
    with pytest.raises(Conflict):
        fleet.release(second[0])
    assert [h["ended"] for h in fleet.history("g1")] == ["expired", "acked"]
    assert fleet.claim("t2", 5, lease_seconds=60) == []


def test_a_holder_may_still_ack_after_its_lease_ran_out_if_nobody_took_the_group(fleet):
    ready(fleet, ["g1"])
    (claim,) = fleet.claim("t0", 1, lease_seconds=0.2)
    time.sleep(0.4)
    assert fleet.counts()["ready"] == 1  # it could be handed out again ...
    fleet.ack(claim)  # ... but its holder got there first
    assert fleet.claim("t1", 1, lease_seconds=60) == [] and fleet.counts()["acked"] == 1


def test_release_renew_and_a_restarted_consumer_taking_up_its_claims(fleet):
    ready(fleet, ["g1", "g2"])
    c1, c2 = fleet.claim("t0", 2, lease_seconds=60)
    assert {c.group_id for c in fleet.held("t0")} == {"g1", "g2"} and fleet.held("t1") == []
    fleet.release(c1)
    fleet.release(c1)  # twice: nothing more
    with pytest.raises(Conflict):
        fleet.ack(c1)
    renewed = fleet.renew(c2, 120)
    assert renewed.lease_id == c2.lease_id and renewed.lease_until > c2.lease_until
    (again,) = fleet.claim("t1", 5, lease_seconds=60)
    assert again.group_id == "g1" and again.lease_id != c1.lease_id
    with pytest.raises(Conflict):
        fleet.renew(c1, 60)
    (mine,) = fleet.held("t0")
    fleet.ack(mine)
    fleet.ack(again)
    assert fleet.counts()["acked"] == 2


def test_channels_never_mix(fleet):
    ready(fleet, ["t1"], channel="train")
    ready(fleet, ["v1"], channel="val")
    assert [c.group_id for c in fleet.claim("trainer", 5, 60)] == ["t1"]
    assert [(c.group_id, c.channel) for c in fleet.claim("eval", 5, 60, channel="val")] == [("v1", "val")]
    ready(fleet, ["t2"])
    ready(fleet, ["v2"], channel="val")
    assert {c.group_id for c in fleet.claim("any", 5, 60, channel=None)} == {"t2", "v2"}


def test_groups_older_than_the_allowed_staleness_are_set_aside(fleet):
    """The rule of one machine's consumer: stale when current - oldest > max_staleness, both integers."""
    assert fleet.policy_version() is None and fleet.max_staleness() is None
    fleet.set_policy_version(5)
    fleet.set_max_staleness(1)
    assert fleet.policy_version() == "5" and fleet.max_staleness() == 1
    ready(fleet, ["old"], version=3)
    ready(fleet, ["recent"], version=4)
    ready(fleet, ["named"], version="exp-a")  # not an integer: never stale (as on one machine)
    ready(fleet, ["unknown"])
    fleet.register_group("mixed", 2)  # one run from version 3, one from 5: its oldest counts
    fleet.register_run("mixed-r0", group_id="mixed", node_id="node-a", policy_version=5)
    fleet.register_run("mixed-r1", group_id="mixed", node_id="node-a")
    fleet.report("mixed-r0", finished=True, committed=True, scored=True)
    fleet.report("mixed-r1", finished=True, committed=True, scored=True, policy_version="3")
    claims = fleet.claim("t", 10, 60)
    assert {c.group_id for c in claims} == {"recent", "named", "unknown"}
    assert {c.group_id: c.policy_version for c in claims}["recent"] == "4"
    assert fleet.counts()["stale"] == 2 and fleet.group("old")["state"] == "stale"
    fleet.set_max_staleness(None)  # no limit: nothing more is set aside, and stale stays stale
    assert fleet.claim("t", 10, 60) == [] and fleet.counts()["stale"] == 2


# --- faults ---------------------------------------------------------------------------------------------

def test_a_consumer_killed_while_holding_claims_gives_them_back_after_its_lease(fleet, url, tmp_path):
    from stepmill.store.fleet_ledger import GroupLease

    ready(fleet, ["g1", "g2", "g3"])
    holder = spawn(hold_claims, url, "doomed", 2, 3.0, str(tmp_path / "claims.json"))
    try:
        held = [GroupLease(**c) for c in json.loads(written(tmp_path / "claims.json"))]
        assert [c.group_id for c in held] == ["g1", "g2"] and holder.is_alive()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
    assert holder.exitcode == -signal.SIGKILL
    killed_at = time.time()
    assert [c.group_id for c in fleet.claim("survivor", 10, 60)] == ["g3"]  # the dead one's are not free yet
    time.sleep(max(0.0, held[0].lease_until - killed_at))
    deadline = time.monotonic() + 10
    back = []
    while len(back) < 2 and time.monotonic() < deadline:
        back += fleet.claim("survivor", 10, 60)
        time.sleep(0.1)
    assert sorted(c.group_id for c in back) == ["g1", "g2"]
    with pytest.raises(Conflict, match="survivor"):
        fleet.ack(held[0])  # what the killed consumer would have sent
    for claim in back:
        fleet.ack(claim)
    assert fleet.counts()["acked"] == 2  # g3 is still held by the survivor
    assert all([h["ended"] for h in fleet.history(g)] == ["expired", "acked"] for g in ("g1", "g2"))


def test_postgresql_restarted_under_consumers_hands_out_no_group_twice_and_loses_none(fleet, url, postgres,
                                                                                       tmp_path):
    groups = ready(fleet, [f"g{i:02d}" for i in range(90)])
    logs = [tmp_path / f"consumer-{i}.log" for i in range(3)]
    workers = [spawn(consume, url, f"c{i}", len(groups), str(log)) for i, log in enumerate(logs)]
    try:
        during = []  # groups acknowledged when each restart began: some, not all
        for threshold, mode in ((10, "immediate"), (35, "immediate"), (60, "fast")):
            # Waited for, not hoped for by a deadline: on a loaded machine the consumers start late.
            wait_until(lambda: fleet.counts()["acked"] >= threshold, timeout=180, interval=0.02,
                       what=f"{threshold} groups acknowledged before the restart")
            during.append(fleet.counts()["acked"])
            postgres.restart(mode)
        for worker in workers:
            finish(worker, 60)
    finally:
        stop(workers)
    assert all(0 < acked < len(groups) for acked in during), during
    assert fleet.counts()["acked"] == len(groups)

    claimed, acked, reconnects = defaultdict(set), defaultdict(set), 0
    for i, log in enumerate(logs):
        for line in log.read_text().splitlines():
            kind, group, lease = line.split()[:3]
            reconnects += int(group) if kind == "reconnects" else 0
            if kind in ("claim", "ack"):
                (claimed if kind == "claim" else acked)[group].add((f"c{i}", int(lease)))
    for group in groups:
        history = fleet.history(group)
        done = [h for h in history if h["ended"] == "acked"]
        assert len(done) == 1, (group, history)  # acknowledged exactly once
        assert {lease for _, lease in acked[group]} == {done[0]["lease_id"]}, (group, acked[group], history)
        assert len({consumer for consumer, _ in acked[group]}) == 1
        # Never held by two at once: each lease ended (ran out, released, acked) before the next began.
        for before, after in zip(history, history[1:]):
            end = before["ended_at"] if before["ended"] in ("released", "acked") else before["lease_until"]
            assert before["ended"] is not None and end <= after["claimed_at"], (group, history)
        assert {lease for _, lease in claimed[group]} <= {h["lease_id"] for h in history}
    assert set(claimed) == set(groups)
    assert reconnects >= 3, "the restarts never cut a consumer's connection"


def test_two_runners_register_into_one_coordinator_at_once(url, tmp_path):
    """On a new database: both runners also create the schema at the same moment."""
    from stepmill.store.fleet_ledger import Coordinator

    go = tmp_path / "go"
    runners = [spawn(run_runner, url, node, 6, 4, go, str(tmp_path / node)) for node in ("node-a", "node-b")]
    try:
        time.sleep(0.5)  # both connected and waiting
        go.touch()
        for runner in runners:
            finish(runner, 60)
    finally:
        stop(runners)
    outcomes = sorted(written(tmp_path / node) for node in ("node-a", "node-b"))
    assert outcomes == ["conflict", "registered"]  # one run id, one node

    fleet = Coordinator(url)
    claims = {c.group_id: c for c in fleet.claim("trainer", 100, 60)}
    assert len(claims) == 6 + 6 + 4 + 1 and fleet.counts()["waiting"] == 0
    for node in ("node-a", "node-b"):
        for g in range(6):
            assert set(claims[f"{node}-g{g}"].runs.values()) == {node}
    for g in range(4):
        shared = claims[f"shared-g{g}"]
        assert len(shared.runs) == 4 and set(shared.nodes) == {"node-a", "node-b"}
        assert all(shared.runs[run] in run for run in shared.runs)
    assert len(claims["contested-g"].runs) == 1
    fleet.close()


def test_a_node_that_stops_heartbeating_has_its_groups_reported_not_handed_out(url):
    from stepmill.store.fleet_ledger import Coordinator

    fleet = Coordinator(url, node_timeout_s=3.0)
    beats = {node: spawn(heartbeat, url, node, 0.2) for node in ("node-a", "node-b")}
    try:
        deadline = time.monotonic() + 30
        while len(fleet.nodes()) < 2:
            assert time.monotonic() < deadline and all(p.is_alive() for p in beats.values())
            time.sleep(0.05)
        ready(fleet, ["a1", "a2"], node="node-a")
        ready(fleet, ["b1"], node="node-b")
        fleet.register_group("ab", 2)  # one run on each node
        fleet.register_run("ab-r0", group_id="ab", node_id="node-a")
        fleet.register_run("ab-r1", group_id="ab", node_id="node-b")
        fleet.report("ab-r0", finished=True, committed=True, scored=True)
        fleet.report("ab-r1", finished=True, committed=True, scored=True)
        assert fleet.lost_groups() == []

        os.kill(beats["node-b"].pid, signal.SIGKILL)
        beats["node-b"].join()
        deadline = time.monotonic() + 15
        while not fleet.lost_groups() and time.monotonic() < deadline:
            time.sleep(0.1)
        lost = fleet.lost_groups()
        assert [(g.group_id, g.node_id, g.state) for g in lost] == [("ab", "node-b", "open"), ("b1", "node-b", "open")]
        assert all("node-b" in g.reason and "heartbeat" in g.reason and g.serve_url for g in lost)
        assert fleet.counts() == {"waiting": 0, "ready": 2, "leased": 0, "acked": 0, "stale": 0, "lost": 2}
        assert sorted(c.group_id for c in fleet.claim("trainer", 10, 60)) == ["a1", "a2"]
        assert fleet.claim("trainer", 10, 60) == []  # not handed out, not dropped
        assert {n["id"]: n["alive"] for n in fleet.nodes()} == {"node-a": True, "node-b": False}
        fleet.set_node_timeout(3.0)  # what every other reader of the coordinator (the CLI here) goes by
        shown = subprocess.run([sys.executable, "-m", "stepmill.cli", "fleet"], capture_output=True, text=True,
                               env={**os.environ, "STEPMILL_COORDINATOR": url}, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "node node-b: SILENT" in shown.stdout and "lost: group b1 on node node-b" in shown.stdout

        fleet.heartbeat("node-b")  # the node comes back: its groups are handed out as before
        assert fleet.lost_groups() == []
        assert sorted(c.group_id for c in fleet.claim("trainer", 10, 60)) == ["ab", "b1"]
    finally:
        stop(beats.values())
        fleet.close()
