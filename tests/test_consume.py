"""The consumption stream: whole groups, each handed out once across consumers, leases that run out,
restarts that resume, staleness and channels."""

import threading
import time

import pytest

from stepmill.errors import Conflict, NotFound
from stepmill.store import Store
from stepmill.store.consumption import Claim
from stepmill.trainer_bridge.consume import Consumer
from stepmill.trainer_bridge.layouts import Batch


def _group(client, group, n, *, channel="train", complete=True, version=None):
    for i in range(n):
        run = client.start_trajectory(group_id=group, channel=channel)
        client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3, i], response_ids=[4, 5],
                           logprobs=[-0.1, -0.2], **({"policy_version": version} if version is not None else {}))
        if complete:
            client.complete_trajectory(run["trajectory_id"], reward=float(i))


def test_groups_are_handed_out_once_to_concurrent_consumers(proxy, marker):
    client = proxy.client()
    channel = f"c-{marker}"
    groups = [f"{marker}-g{i}" for i in range(6)]
    for group in groups:
        _group(client, group, 2, channel=channel)
    _group(client, f"{marker}-open", 2, channel=channel, complete=False)  # not ready: rollouts still open
    _group(client, f"{marker}-small", 1, channel=channel)  # not ready: fewer than n
    _group(client, f"{marker}-val", 2, channel=f"val-{marker}")  # another channel: never mixed in
    got: dict[str, list] = {"a": [], "b": []}

    def consume(name):
        consumer = Consumer(Store(proxy.db), name, n=2, channel=channel)
        for batch in consumer:  # each next() acknowledges the batch before
            assert len(batch) == 2 and set(batch.meta["uid"]) == {batch.meta["group_id"]}
            assert batch.tensors["token_level_scores"].sum() == 1.0  # rewards 0 and 1 on the last tokens
            got[name].append(batch.meta["group_id"])
            time.sleep(0.01)

    threads = [threading.Thread(target=consume, args=(name,)) for name in got]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(got["a"] + got["b"]) == sorted(groups)
    assert not set(got["a"]) & set(got["b"])


def test_a_dead_consumers_group_comes_back_and_a_restart_resumes(proxy, marker):
    client = proxy.client()
    channel = f"l-{marker}"
    _group(client, f"{marker}-x", 2, channel=channel)
    _group(client, f"{marker}-y", 2, channel=channel)
    dying = Consumer(Store(proxy.db), "dying", n=2, channel=channel, lease_seconds=0.3)
    held = dying.claim()  # ... and the process dies without acknowledging
    other = Consumer(Store(proxy.db), "other", n=2, channel=channel, lease_seconds=0.3)
    second = other.claim()
    assert second.meta["group_id"] != held.meta["group_id"]
    other.ack(second)
    assert other.claim() is None  # the dead consumer's lease still runs
    time.sleep(0.4)
    taken_over = other.claim()
    assert taken_over.meta["group_id"] == held.meta["group_id"]
    other.ack(taken_over)

    restarted = Consumer(Store(proxy.db), "restarts", n=2, channel=channel)
    _group(client, f"{marker}-z", 2, channel=channel)
    first = restarted.claim()
    again = Consumer(Store(proxy.db), "restarts", n=2, channel=channel).claim()  # same name, after a restart
    assert again.meta["group_id"] == first.meta["group_id"] == f"{marker}-z"
    rows = proxy.store().query("SELECT consumer, status FROM consumption WHERE group_id LIKE ?", [f"{marker}-%"])
    assert sorted((r["consumer"], r["status"]) for r in rows) == [("other", "acked"), ("other", "acked"),
                                                                ("restarts", "leased")]


def test_stale_groups_are_set_aside_and_counted(proxy, marker):
    client = proxy.client()
    channel = f"s-{marker}"
    store = proxy.store()
    store.set_policy_version(10)
    old = client.start_trajectory(group_id=f"{marker}-old", channel=channel)
    store.db.conn.execute("UPDATE trajectories SET policy_version = '2' WHERE id = ?", [old["trajectory_id"]])
    client.complete_trajectory(old["trajectory_id"])
    _group(client, f"{marker}-new", 1, channel=channel)
    consumer = Consumer(Store(proxy.db), "fresh", n=1, channel=channel, max_staleness=3)
    batch = consumer.claim()
    assert batch.meta["group_id"] == f"{marker}-new" and consumer.report["groups set aside: stale"] == 1
    store.set_policy_version(None)


def test_a_remote_trainer_pulls_over_http(proxy, marker):
    import subprocess
    import urllib.error
    import urllib.request

    import pytest

    from stepmill.fleet.node_consumer import NodeConsumer

    from .conftest import STEPMILL, free_port, wait_until

    client = proxy.client()
    channel = f"r-{marker}"
    _group(client, f"{marker}-remote", 2, channel=channel)
    port = free_port()
    server = subprocess.Popen(STEPMILL + ["serve", "--db", str(proxy.db), "--port", str(port),
                                          "--confdir", str(proxy.confdir)], stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return urllib.request.urlopen(url + "/v1/health", timeout=2).status == 200
            except OSError:
                return False

        wait_until(up, timeout=30, what="stepmill serve")
        trainer = NodeConsumer(url, "remote-0", confdir=str(proxy.confdir), n=2, channel=channel)
        batches = list(trainer)  # iterating acknowledges each batch as the next is asked for
        assert [b.meta["group_id"] for b in batches] == [f"{marker}-remote"]
        assert batches[0].tensors["input_ids"].shape == (2, 6)
        assert batches[0].tensors["rollout_log_probs"].dtype.name == "float32"
        assert trainer.claim() is None
        from stepmill.ui.lifecycle import lifecycle

        consumed = lifecycle(Store(str(proxy.db), readonly=True))["consumed"]["by_consumer"]
        assert [(c["groups"], c["rows"]) for c in consumed if c["consumer"] == "remote-0"] == [(1, 2)]
        with pytest.raises(urllib.error.HTTPError) as twice:
            trainer.ack(batches[0])  # acknowledged already, when the next batch was asked for
        assert twice.value.code == 409
        with pytest.raises(urllib.error.HTTPError) as unknown:
            trainer.ack(Batch({}, {"group_id": f"{marker}-never-claimed"}))
        assert unknown.value.code == 404
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:  # the same stream as a torch IterableDataset
            _group(client, f"{marker}-torch", 2, channel=channel)
            loaded = list(torch.utils.data.DataLoader(trainer.as_torch_dataset(), batch_size=None))
            assert len(loaded) == 1 and loaded[0]["input_ids"].shape == (2, 6)
        with pytest.raises(urllib.error.HTTPError) as anonymous:
            NodeConsumer(url, "intruder", token="wrong", n=2, channel=channel).claim()
        assert anonymous.value.code == 401
    finally:
        server.terminate()
        server.wait(10)


def test_the_stores_claims_leases_and_acks(tmp_path):
    """The contract of ``Store.claim_group``/``ack_group`` on the store alone, on a clock of its own."""
    store = Store(str(tmp_path / "consume.db"))

    def group(group_id, size, version):
        store.set_policy_version(version)
        for _ in range(size):
            store.complete_trajectory(store.start_trajectory(group_id=group_id, channel="train")["id"])

    group("old", 2, 2)
    store.set_policy_version(10)
    assert store.claim_group("a", n=2, max_staleness=3, now=100.0) == Claim(None, stale=1)
    group("g", 2, 10)
    assert store.claim_group("a", n=3, now=100.0) == Claim(None)  # fewer than n complete
    assert store.claim_group("a", n=2, lease_seconds=10, now=100.0) == Claim("g")
    assert store.claim_group("b", n=2, now=105.0) == Claim(None)  # leased to a; "old" set aside for good
    assert store.claim_group("a", n=2, lease_seconds=10, now=105.0) == Claim("g")  # a restarted: its own again
    with pytest.raises(NotFound):
        store.ack_group("a", "never-claimed", rows=0)
    with pytest.raises(Conflict):
        store.ack_group("b", "g", rows=2)  # not b's
    assert store.claim_group("b", n=2, now=200.0) == Claim("g")  # a's lease ran out at 115
    with pytest.raises(Conflict, match=r"^group 'g' is not leased to 'a' \(its lease ran out\?\)$"):
        store.ack_group("a", "g", rows=2)
    store.set_group_rows("a", "g", 5)  # a no longer holds it: nothing changes
    store.set_group_rows("b", "g", 2)  # the batch b was handed had 2 rows
    store.ack_group("b", "g")  # an ack without a count (over HTTP) keeps it
    with pytest.raises(Conflict):
        store.ack_group("b", "g", rows=2)  # an ack takes effect once
    group("h", 2, 10)
    assert store.claim_group("c", n=2, now=10_000.0) == Claim("h")
    store.set_group_rows("c", "h", 7)
    store.ack_group("c", "h", rows=3)  # a count given with the ack wins
    assert store.claim_group("c", n=2, now=10_000.0) == Claim(None)
    rows = {r["group_id"]: (r["consumer"], r["status"], r["rows"])
            for r in store.query("SELECT group_id, consumer, status, rows FROM consumption")}
    assert rows == {"g": ("b", "acked", 2), "h": ("c", "acked", 3), "old": ("a", "stale", None)}
    store.close()
