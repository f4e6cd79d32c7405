"""Several groups per optimizer step: claimed together, acknowledged together in one transaction (all
or none), given back together; a trainer killed between claim and ack gives its groups back (to
itself restarted at once, to anyone when the lease runs out); each claim's staleness kept.

The trainers are real processes (``TRAINER`` below, killed with SIGKILL where a test says so) on a
real SQLite file, over HTTP (`stepmill serve` + ``NodeConsumer``) and through the fleet's coordinator
on a real PostgreSQL (``RemoteConsumer``, nodes served by `stepmill serve --node-id`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.auth.write_token import ensure_token
from stepmill.children import free_port
from stepmill.errors import BadInput, Conflict, NotFound
from stepmill.store import StepRecord, Store
from stepmill.trainer_bridge.consume import Consumer, staleness_summary

from .conftest import STEPMILL, wait_until

# A trainer process. It claims ``k`` groups at a time with the consumer of ``how`` (sqlite | http | fleet)
# and writes one JSON line per event to ``out``. Modes: ``hold``: claim once, say so, wait to be killed;
# ``once``: claim once, ack together, exit; ``loop``: claim, train ``hold`` s (renewing halfway), ack
# together, until nothing was handed out for ``quiet`` s.
TRAINER = r"""
import json, sys, time
from stepmill.errors import Conflict

how, target, name, k, lease, out, mode, hold, quiet = sys.argv[1:10]
go = sys.argv[10] if len(sys.argv) > 10 else None  # a file whose existence says: start claiming (all at once)
target, k, lease, hold, quiet = json.loads(target), int(k), float(lease), float(hold), float(quiet)
if how == "sqlite":
    from stepmill.store import Store
    from stepmill.trainer_bridge.consume import Consumer
    trainer = Consumer(Store(target["db"]), name, n=2, lease_seconds=lease)
elif how == "http":
    from stepmill.fleet.node_consumer import NodeConsumer
    trainer = NodeConsumer(target["url"], name, token=target["token"], n=2, lease_seconds=lease)
else:
    from stepmill.fleet.remote_consumer import RemoteConsumer
    trainer = RemoteConsumer(target["url"], name, token=target["token"], lease_seconds=lease)
with open(out, "a") as log:
    def say(**event):
        log.write(json.dumps({"consumer": name, **event}) + "\n")
        log.flush()
    if go:
        say(event="ready")
        while not __import__("os").path.exists(go):
            time.sleep(0.02)
    last = time.monotonic()
    while time.monotonic() - last < quiet:
        before = time.time()
        batches = trainer.claim_many(k)
        if not batches:
            time.sleep(0.05)
            continue
        last = time.monotonic()
        groups = [b.meta["group_id"] for b in batches]
        say(event="claimed", groups=groups, rows=[len(b) for b in batches], before=before)
        if mode == "hold":
            time.sleep(3600)
        time.sleep(hold / 2)
        lost = trainer.renew()
        time.sleep(hold / 2)
        try:
            trainer.ack_many(batches)
            say(event="acked", groups=groups, lost=lost)
        except Conflict as exc:
            say(event="conflict", groups=groups, error=str(exc))
        if mode == "once":
            break
        last = time.monotonic()
    say(event="done")
"""


def start_trainer(how: str, target: dict, name: str, out: Path, *, k: int = 3, lease: float = 600,
                  mode: str = "loop", hold: float = 0.05, quiet: float = 2.0, go: Path | None = None) -> subprocess.Popen:
    """A trainer process; with ``go``, it says it is ready and claims nothing until that file exists."""
    return subprocess.Popen([sys.executable, "-c", TRAINER, how, json.dumps(target), name, str(k), str(lease),
                             str(out), mode, str(hold), str(quiet), *([str(go)] if go else [])],
                            stderr=(out.parent / f"{out.stem}.err").open("ab"))


def events(*outs: Path) -> list[dict]:
    return [json.loads(line) for out in outs if out.exists() for line in out.read_text().splitlines()]


def claimed_by(out: Path, timeout: float = 60) -> list[str]:
    """The groups a holding trainer said it claimed."""
    return the_claim(out, timeout)["groups"]


def the_claim(out: Path, timeout: float = 60) -> dict:
    """A holding trainer's claim: groups, rows, before (the time just before it claimed)."""
    wait_until(lambda: events(out), timeout=timeout, what=f"the claim of {out.stem}")
    [claim] = [e for e in events(out) if e["event"] == "claimed"]
    return claim


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(10)


def finished(process: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    assert process.wait(timeout) == 0, (out.parent / f"{out.stem}.err").read_text()


def add_run(store: Store, group: str, run: str, *, channel: str = "train", reward: float = 0.0) -> None:
    """A run as a runner leaves it: registered, one step with token ids, completed with a reward."""
    store.start_trajectory(trajectory_id=run, group_id=group, channel=channel)
    store.register_run(run, "unused")
    store.record_step(StepRecord(api="openai.chat", messages=[{"role": "user", "content": run}],
                                 completion={"role": "assistant", "content": "a"}, trajectory_id=run,
                                 prompt_ids=[1, 2, 3, int(reward)], response_ids=[4, 5], logprobs=[-0.1, -0.2],
                                 token_provenance="exact", is_last=True))
    store.complete_trajectory(run, reward=reward)


def make_groups(store: Store, prefix: str, count: int, *, size: int = 2) -> list[str]:
    """``count`` ready groups of ``size`` runs, oldest first."""
    groups = [f"{prefix}-{g:02d}" for g in range(count)]
    for group in groups:
        for r in range(size):
            add_run(store, group, f"{group}-r{r}", reward=float(r))
    return groups


def acks_in_table(store: Store) -> Counter:
    """How many times each group stands acknowledged in the consumption table."""
    return Counter(row["group_id"] for row in store.consumption_staleness() if row["status"] == "acked")


def acked_events(*outs: Path) -> Counter:
    return Counter(g for e in events(*outs) if e["event"] == "acked" for g in e["groups"])


@pytest.fixture
def db(tmp_path) -> Path:
    return tmp_path / "steps.db"


# --- one SQLite file ---------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_a_trainer_killed_between_claim_and_ack_gives_its_groups_back(db, tmp_path):
    store = Store(db)
    groups = make_groups(store, "k", 9)
    target = {"db": str(db)}
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = start_trainer("sqlite", target, "trainer-a", a_out, mode="hold")
    held_a = claimed_by(a_out)
    kill(a)  # three groups claimed, never acknowledged
    b = start_trainer("sqlite", target, "trainer-b", b_out, mode="hold", lease=3)
    claim_b = the_claim(b_out)
    held_b = claim_b["groups"]
    kill(b)
    assert len(held_a) == len(held_b) == 3 and not set(held_a) & set(held_b)

    other = Consumer(Store(db), "other", n=2)
    rest = other.claim_many(9)  # neither dead trainer's groups: their leases still run
    assert sorted(b.meta["group_id"] for b in rest) == sorted(set(groups) - set(held_a) - set(held_b))
    other.ack_many(rest)

    again_out = tmp_path / "a-again.jsonl"
    again = start_trainer("sqlite", target, "trainer-a", again_out, mode="once")  # restarted, same name
    finished(again, again_out)
    [claim] = [e for e in events(again_out) if e["event"] == "claimed"]
    assert claim["groups"] == held_a and claim["rows"] == [2, 2, 2]  # exactly its own, at once
    assert [e["groups"] for e in events(again_out) if e["event"] == "acked"] == [held_a]

    back = wait_until(lambda: other.claim_many(9), timeout=15, what="the dead trainer's groups after its lease")
    assert time.time() >= claim_b["before"] + 3  # not before its lease ran out
    assert sorted(b.meta["group_id"] for b in back) == sorted(held_b)
    other.ack_many(back)
    assert acks_in_table(store) == Counter(groups)
    owners = {row["group_id"]: row["consumer"] for row in store.consumption_staleness()}
    assert {owners[g] for g in held_a} == {"trainer-a"} and {owners[g] for g in held_b} == {"other"}
    assert other.claim_many(9) == []


@pytest.mark.timeout(180)
def test_two_trainers_claiming_several_each_never_share_a_group(db, tmp_path):
    store = Store(db)
    groups = make_groups(store, "c", 24)
    outs = [tmp_path / f"t{i}.jsonl" for i in range(2)]
    go = tmp_path / "go"
    trainers = [start_trainer("sqlite", {"db": str(db)}, f"trainer-{i}", out, k=3, hold=0.1, quiet=1.5, go=go)
                for i, out in enumerate(outs)]
    # Both started before either claims: on a busy machine one may start seconds after the other.
    wait_until(lambda: all(any(e["event"] == "ready" for e in events(out)) for out in outs), timeout=120,
               what="both trainers ready")
    go.touch()
    for trainer, out in zip(trainers, outs):
        finished(trainer, out)
    mine = [{g for e in events(out) if e["event"] == "claimed" for g in e["groups"]} for out in outs]
    assert mine[0] and mine[1] and not mine[0] & mine[1]  # both took part, never the same group
    claims = Counter(g for e in events(*outs) if e["event"] == "claimed" for g in e["groups"])
    assert claims == Counter(groups) == acked_events(*outs) == acks_in_table(store)
    assert not [e for e in events(*outs) if e["event"] == "conflict" or e.get("lost")]
    owners = {row["group_id"]: row["consumer"] for row in store.consumption_staleness()}
    assert all(owners[g] == f"trainer-{i}" for i, groups_i in enumerate(mine) for g in groups_i)


def test_an_ack_together_with_one_lost_lease_acknowledges_none(db):
    store = Store(db)
    make_groups(store, "l", 4)
    slow = Consumer(Store(db), "slow", n=2, lease_seconds=0.3)
    batches = slow.claim_many(3)
    first, *others = [b.meta["group_id"] for b in batches]
    time.sleep(0.5)  # no renewal: the leases run out
    fast = Consumer(Store(db), "fast", n=2)
    taken = fast.claim_many(1)
    assert [b.meta["group_id"] for b in taken] == [first]  # the oldest ready
    with pytest.raises(Conflict, match=rf"{first!r}.*none of the 3 groups was acknowledged") as refused:
        slow.ack_many(batches)
    assert not any(repr(g) in str(refused.value) for g in others)  # it names the lost group only
    assert acks_in_table(store) == Counter()  # nothing acknowledged
    assert slow.held == [first, *others]
    assert slow.renew() == [first]  # the others are still its own
    assert slow.release_many(batches) == others  # given back at once
    assert slow.held == []
    again = fast.claim_many(5)
    assert sorted(b.meta["group_id"] for b in again) == sorted(others + ["l-03"])
    fast.ack_many(taken + again)
    assert acks_in_table(store) == Counter(["l-00", "l-01", "l-02", "l-03"])
    with pytest.raises(Conflict):
        fast.ack_many(taken)  # an ack takes effect once
    with pytest.raises(NotFound, match="'never'"):
        store.ack_groups("fast", ["never"])


def test_a_consumer_never_gets_a_group_it_holds_and_renewing_keeps_them(db):
    store = Store(db)
    groups = make_groups(store, "r", 5)
    trainer = Consumer(Store(db), "trainer", n=2, lease_seconds=1.0)
    one, two = trainer.claim(), trainer.claim()  # a loop on claim(): the next group each time
    assert [one.meta["group_id"], two.meta["group_id"]] == groups[:2]
    rest = trainer.claim_many(10)
    assert [b.meta["group_id"] for b in rest] == groups[2:] and trainer.claim_many(10) == []
    held = [one, two] + rest
    other = Consumer(Store(db), "other", n=2)
    deadline = time.time() + 2.5  # longer than two leases: renewed, none runs out
    while time.time() < deadline:
        assert trainer.renew() == []
        assert other.claim_many(10) == []
        time.sleep(0.1)
    with trainer.step(2) as nothing:  # it holds every group: nothing more to claim, nothing to ack
        assert nothing == []
    time.sleep(1.2)  # no renewal now
    taken = other.claim_many(2)
    assert [b.meta["group_id"] for b in taken] == groups[:2]
    assert trainer.renew() == groups[:2]
    with pytest.raises(Conflict):
        trainer.ack_many(held)
    trainer.release_many(held)
    with pytest.raises(RuntimeError), other.step(10) as batches:  # a failed step gives its groups back
        assert [b.meta["group_id"] for b in batches] == groups[2:]
        raise RuntimeError("the optimizer step failed")
    with other.step(10) as batches:
        assert [b.meta["group_id"] for b in batches] == groups[2:]
    other.ack_many(taken)
    assert acks_in_table(store) == Counter(groups)


def test_the_staleness_of_each_claimed_group_is_kept_and_shown(db):
    store = Store(db)
    store.set_policy_version(3)
    make_groups(store, "old", 1)
    store.set_policy_version(9)
    mixed = "mixed"  # versions 9 and 10: compared as numbers, not as text
    add_run(store, mixed, "mixed-r0")
    store.set_policy_version(10)
    add_run(store, mixed, "mixed-r1", reward=1.0)
    store.set_policy_version("exp-a")
    make_groups(store, "named", 1)
    store.set_policy_version(12)
    trainer = Consumer(Store(db), "trainer", n=1, max_staleness=5)
    batches = trainer.claim_many(10)
    assert [b.meta["group_id"] for b in batches] == [mixed, "named-00"]
    assert trainer.report["groups set aside: stale"] == 1
    trainer.ack_many(batches)
    rows = {row["group_id"]: row for row in store.consumption_staleness()}
    assert {g: (r["status"], r["staleness"], r["policy_version"], r["oldest_version"]) for g, r in rows.items()} == {
        "old-00": ("stale", 9, "12", "3"), mixed: ("acked", 3, "12", "9"), "named-00": ("acked", None, "12", "exp-a")}
    assert rows[mixed]["consumer"] == "trainer" and rows[mixed]["rows"] == 2
    assert [r["group_id"] for r in store.consumption_staleness(consumer="nobody")] == []
    shown = subprocess.run(STEPMILL + ["stats", "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert ("groups handed out: 2 (2 acked); staleness at claim: mean 3.00, max 3 of 1 with integer versions"
            in shown.stdout.splitlines())


ROW = st.fixed_dictionaries({"status": st.sampled_from(["leased", "acked", "released", "stale"]),
                             "staleness": st.none() | st.integers(-5, 10**6)})


@given(st.lists(ROW, max_size=30))
@settings(max_examples=200, deadline=None)
def test_the_staleness_line_counts_what_was_handed_out(rows):
    line = staleness_summary(iter(rows))  # read once: a generator will do
    handed = [r for r in rows if r["status"] != "stale"]
    if not handed:
        assert line is None
        return
    assert line.startswith(f"groups handed out: {len(handed)} (")
    known = [r["staleness"] for r in handed if r["staleness"] is not None]
    if known:
        assert line.endswith(f", max {max(known)} of {len(known)} with integer versions")
    else:
        assert line.endswith("unknown (policy versions not integers)")
    for status in ("acked", "leased", "released"):
        count = sum(r["status"] == status for r in handed)
        assert (f"{count} {status}" in line) == (count > 0)


# --- over HTTP: `stepmill serve` and NodeConsumer -------------------------------------------------------------

@pytest.fixture
def served(db, tmp_path):
    """`stepmill serve` of the file: (its URL, the write token)."""
    confdir = tmp_path / "conf"
    token = ensure_token(str(confdir))
    Store(db).close()
    port = free_port()
    server = subprocess.Popen(STEPMILL + ["serve", "--db", str(db), "--port", str(port), "--confdir", str(confdir)],
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert server.poll() is None, "stepmill serve exited"
        try:
            return urllib.request.urlopen(url + "/v1/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_until(up, timeout=60, what="stepmill serve")
        yield url, token
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.timeout(120)
def test_over_http_several_are_claimed_and_acknowledged_together(db, served):
    from stepmill.fleet.node_consumer import NodeConsumer

    url, token = served
    store = Store(db)
    groups = make_groups(store, "h", 6)
    trainer = NodeConsumer(url, "trainer", token=token, n=2)
    batches = trainer.claim_many(3)
    assert [b.meta["group_id"] for b in batches] == groups[:3]
    assert all(b.tensors["input_ids"].shape == (2, 6) and set(b.meta["uid"]) == {b.meta["group_id"]}
               for b in batches)
    assert [b.meta["group_id"] for b in trainer.claim_many(2)] == groups[3:5]  # never its own again
    assert trainer.renew() == []
    trainer.ack_many(batches)
    assert acks_in_table(store) == Counter(groups[:3])
    assert {r["group_id"]: r["rows"] for r in store.consumption_staleness(consumer="trainer")}[groups[0]] == 2

    assert trainer.held == groups[3:5]
    restarted = NodeConsumer(url, "trainer", token=token, n=2)  # the same name, a new process
    resumed = restarted.claim_many(2)
    assert [b.meta["group_id"] for b in resumed] == groups[3:5]  # its held groups first
    assert [b.meta["group_id"] for b in restarted.claim_many(3)] == groups[5:]
    with pytest.raises(Conflict):  # the old process's session no longer holds them
        trainer.ack_many(resumed)
    restarted.ack_many(resumed)
    with restarted.step(3) as nothing:
        assert nothing == []
    assert acks_in_table(store) == Counter(groups[:5])


@pytest.mark.timeout(120)
def test_over_http_an_ack_with_one_lost_lease_acknowledges_none(db, served):
    from stepmill.fleet.node_consumer import NodeConsumer

    url, token = served
    store = Store(db)
    groups = make_groups(store, "x", 3)
    slow = NodeConsumer(url, "slow", token=token, n=2, lease_seconds=0.3)
    batches = slow.claim_many(3)
    assert [b.meta["group_id"] for b in batches] == groups
    time.sleep(0.5)
    fast = NodeConsumer(url, "fast", token=token, n=2)
    taken = fast.claim_many(1)
    assert [b.meta["group_id"] for b in taken] == groups[:1]
    with pytest.raises(Conflict, match=rf"{groups[0]!r}.*none of the 3 groups was acknowledged") as refused:
        slow.ack_many(batches)
    assert isinstance(refused.value, urllib.error.HTTPError) and refused.value.code == 409
    assert acks_in_table(store) == Counter()
    assert slow.renew() == groups[:1]
    assert slow.release_many(batches) == groups[1:]
    again = fast.claim_many(5)
    fast.ack_many(taken + again)
    assert acks_in_table(store) == Counter(groups)
    with pytest.raises(NotFound):
        fast.ack_many([type(taken[0])({}, {"group_id": "never-claimed"})])


@pytest.mark.timeout(180)
def test_over_http_a_trainer_killed_between_claim_and_ack_gives_its_groups_back(db, served, tmp_path):
    from stepmill.fleet.node_consumer import NodeConsumer

    url, token = served
    store = Store(db)
    groups = make_groups(store, "hk", 7)
    target = {"url": url, "token": token}
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = start_trainer("http", target, "trainer-a", a_out, mode="hold")
    held_a = claimed_by(a_out)
    kill(a)
    b = start_trainer("http", target, "trainer-b", b_out, k=2, mode="hold", lease=3)
    claim_b = the_claim(b_out)
    held_b = claim_b["groups"]
    kill(b)
    other = NodeConsumer(url, "other", token=token, n=2)
    rest = other.claim_many(10)
    assert sorted(b.meta["group_id"] for b in rest) == sorted(set(groups) - set(held_a) - set(held_b))
    other.ack_many(rest)
    again_out = tmp_path / "a-again.jsonl"
    again = start_trainer("http", target, "trainer-a", again_out, mode="once")
    finished(again, again_out)
    assert [e["groups"] for e in events(again_out) if e["event"] in ("claimed", "acked")] == [held_a, held_a]
    back = wait_until(lambda: other.claim_many(10), timeout=15, what="the dead trainer's groups after its lease")
    assert time.time() >= claim_b["before"] + 3  # not before its lease ran out
    assert sorted(b.meta["group_id"] for b in back) == sorted(held_b)
    other.ack_many(back)
    assert acks_in_table(store) == Counter(groups)


# --- the fleet: RemoteConsumer through the coordinator ------------------------------------------------------

@pytest.fixture
def node(fleet, url, db, tmp_path):
    """One node: a SQLite file served by `stepmill serve --node-id`, publishing to the coordinator."""
    from .fleet_processes import start_serve

    confdir = tmp_path / "conf"
    token = ensure_token(str(confdir))
    store = Store(db)
    store.set_policy_version(2)
    serve, serve_url = start_serve("node-q", db, confdir, url, tmp_path)
    try:
        yield store, token
    finally:
        serve.terminate()
        serve.wait(10)


@pytest.mark.timeout(180)
def test_through_the_coordinator_several_are_claimed_and_acknowledged_together(fleet, url, node):
    from stepmill.fleet.remote_consumer import RemoteConsumer

    from .fleet_processes import acks_by_group

    store, token = node
    groups = make_groups(store, "f", 5)
    fleet.set_policy_version(5)
    wait_until(lambda: fleet.counts()["ready"] == len(groups), timeout=30, what="every group ready")
    with RemoteConsumer(url, "trainer", token=token) as trainer:
        batches = trainer.claim_many(3)
        assert [b.meta["group_id"] for b in batches] == groups[:3]
        assert all(len(b) == 2 and b.meta["nodes"] == ["node-q"] for b in batches)
        assert [b.meta["group_id"] for b in trainer.claim_many(1)] == [groups[3]]  # never one it holds
        trainer.ack_many(batches)
        assert acks_by_group(fleet, groups) == Counter(groups[:3])
        history = fleet.history(groups[0])
        assert (history[-1]["ended"], history[-1]["staleness"], history[-1]["policy_version"]) == ("acked", 3, "5")

    slow = RemoteConsumer(url, "slow", token=token, lease_seconds=0.5)
    slow.close()  # it renews nothing: its leases run out
    held = slow.claim_many(3)
    assert [b.meta["group_id"] for b in held] == groups[4:]
    fleet.set_policy_version(6)
    time.sleep(0.7)
    (claim,) = fleet.claim("fast", 1, lease_seconds=60)
    assert claim.group_id == groups[4] and claim.staleness == 4
    with pytest.raises(Conflict, match=rf"{groups[4]!r}.*leased to 'fast'") as refused:
        slow.ack_many(held)
    assert refused.value.groups == [groups[4]] and slow.held == []
    fleet.ack(claim)
    trainer = RemoteConsumer(url, "trainer", token=token)  # restarted: takes up its held group first
    (again,) = trainer.claim_many(3)
    assert again.meta["group_id"] == groups[3]
    trainer.ack_many([again])
    trainer.close()
    assert acks_by_group(fleet, groups) == Counter(groups)


@pytest.mark.timeout(180)
def test_through_the_coordinator_a_lost_lease_makes_the_whole_ack_a_conflict(fleet, url, node):
    from stepmill.fleet.remote_consumer import RemoteConsumer

    from .fleet_processes import acks_by_group

    store, token = node
    groups = make_groups(store, "fl", 3)
    wait_until(lambda: fleet.counts()["ready"] == len(groups), timeout=30, what="every group ready")
    slow = RemoteConsumer(url, "slow", token=token, lease_seconds=0.5)
    slow.close()
    batches = slow.claim_many(3)
    time.sleep(0.7)
    (claim,) = fleet.claim("thief", 1, lease_seconds=60)
    with pytest.raises(Conflict, match=rf"{claim.group_id!r}.*'thief'.*None of the 3 groups was acknowledged"):
        slow.ack_many(batches)
    assert fleet.counts()["acked"] == 0 and sorted(slow.held) == sorted(set(groups) - {claim.group_id})
    assert sorted(slow.release_many(batches)) == sorted(slow_groups := set(groups) - {claim.group_id})
    fast = RemoteConsumer(url, "fast", token=token)
    taken = fast.claim_many(5)
    assert sorted(b.meta["group_id"] for b in taken) == sorted(slow_groups)
    fast.ack_many(taken)
    fleet.ack(claim)
    fast.close()
    assert acks_by_group(fleet, groups) == Counter(groups)

    [old] = make_groups(store, "fl-old", 1)  # at the file's policy version, 2
    fleet.set_policy_version(5)
    wait_until(lambda: fleet.counts()["ready"] == 1, timeout=30, what="the old group ready")
    with pytest.raises(BadInput):
        fleet.claim("picky", 1, 60, max_staleness=-1)
    with RemoteConsumer(url, "picky", token=token, max_staleness=2) as picky:  # tighter than the fleet's none
        assert picky.claim_many(5) == []
    assert fleet.group(old)["state"] == "stale" and fleet.counts()["stale"] == 1


@pytest.mark.timeout(240)
def test_through_the_coordinator_a_trainer_killed_between_claim_and_ack_gives_its_groups_back(fleet, url, node,
                                                                                                tmp_path):
    from stepmill.fleet.remote_consumer import RemoteConsumer

    from .fleet_processes import acks_by_group

    store, token = node
    groups = make_groups(store, "fk", 7)
    wait_until(lambda: fleet.counts()["ready"] == len(groups), timeout=30, what="every group ready")
    target = {"url": url, "token": token}
    a_out, b_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = start_trainer("fleet", target, "trainer-a", a_out, mode="hold")
    held_a = claimed_by(a_out)
    kill(a)
    b = start_trainer("fleet", target, "trainer-b", b_out, k=2, mode="hold", lease=3)
    claim_b = the_claim(b_out)
    held_b = claim_b["groups"]
    kill(b)
    with RemoteConsumer(url, "other", token=token) as other:
        rest = other.claim_many(10)
        assert sorted(b.meta["group_id"] for b in rest) == sorted(set(groups) - set(held_a) - set(held_b))
        other.ack_many(rest)
        again_out = tmp_path / "a-again.jsonl"
        again = start_trainer("fleet", target, "trainer-a", again_out, mode="once")
        finished(again, again_out)
        assert [e["groups"] for e in events(again_out) if e["event"] in ("claimed", "acked")] == [held_a, held_a]
        back = wait_until(lambda: other.claim_many(10), timeout=20, what="the dead trainer's groups after its lease")
        assert time.time() >= claim_b["before"] + 2.9  # the server's clock, on this machine
        assert sorted(b.meta["group_id"] for b in back) == sorted(held_b)
        other.ack_many(back)
    assert acks_by_group(fleet, groups) == Counter(groups)
    assert all(fleet.history(g)[0]["ended"] == "expired" and fleet.history(g)[-1]["consumer"] == "other"
               for g in held_b)


def test_a_trainer_that_asks_for_scored_groups_waits_for_their_rewards(tmp_path):
    """A rollout scores a round once it ends: a trainer never gets a group some of whose runs have no reward."""
    store = Store(str(tmp_path / "scored.db"))
    for i in range(2):
        store.start_trajectory(trajectory_id=f"s-{i}", group_id="g-scored", channel="train")
        store.complete_trajectory(f"s-{i}")
    store.add_reward("s-0", 1.0)
    trainer = Consumer(store, "trainer", n=2, scored=True)
    assert trainer.claim_many(2) == []
    assert [b.meta["group_id"] for b in Consumer(store, "plain", n=2).claim_many(2)] == ["g-scored"]
    store.release_groups("plain", ["g-scored"])
    store.add_reward("s-1", 0.0)
    assert [b.meta["group_id"] for b in trainer.claim_many(2)] == ["g-scored"]


# A trainer started before anything it needs exists: its consumer waits (``wait_s``) for the nodes' write token
# and the first groups, then iterates until no group is ready within ``wait_s``; one line per group it trained on.
EARLY_TRAINER = r"""
import sys
from stepmill.fleet.remote_consumer import RemoteConsumer
url, confdir = sys.argv[1:3]
with RemoteConsumer(url, "early", confdir=confdir, wait_s=25) as trainer:
    for batch in trainer:
        print(batch.meta["group_id"], len(batch), flush=True)
"""


@pytest.mark.slow  # its first progress line comes after 10 s, and it waits out 25 s idle at the end
@pytest.mark.timeout(180)
def test_a_trainer_started_before_the_rollout_waits_then_consumes_every_group_once(fleet, url, db, tmp_path):
    """No token, no node, no group when it starts: it says what it waits for, then trains on each group
    once, and ends once none has come for ``wait_s``."""
    from .fleet_processes import acks_by_group, start_serve

    confdir = tmp_path / "conf"
    said = tmp_path / "trainer.err"
    trainer = subprocess.Popen([sys.executable, "-c", EARLY_TRAINER, url, str(confdir)], text=True,
                               stdout=subprocess.PIPE, stderr=said.open("w"))
    serve = None
    try:
        wait_until(lambda: "waiting for the nodes' write token" in said.read_text() or trainer.poll() is not None,
                   timeout=60, what="the trainer's first progress line")
        assert trainer.poll() is None, said.read_text()
        ensure_token(str(confdir))  # what the rollout does first
        store = Store(db)
        serve, _ = start_serve("node-early", db, confdir, url, tmp_path)
        groups = make_groups(store, "early", 4)
        out, _ = trainer.communicate(timeout=150)
    finally:
        trainer.kill()
        if serve is not None:
            serve.terminate()
            serve.wait(10)
    err = said.read_text()
    assert trainer.returncode == 0, err
    assert f"waiting for the nodes' write token ({confdir / 'stepmill-token'}" in err, err
    assert sorted(line.split()[0] for line in out.splitlines()) == groups, out
    assert acks_by_group(fleet, groups) == Counter(groups)
    assert "no group ready after 25 s (wait_s)" in err, err
