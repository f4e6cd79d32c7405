"""`stepmill proxy --workers 2`, really started: two mitmproxy processes on one port, one database.

Every call is recorded once whichever worker took it, and both take calls (health lists each worker's
count); a policy version set through either is stamped by both from the next call; a run registered
through one is admitted by the other at once; a barrier waits for calls in flight on the other; a
worker killed with -9 is started again and its finished calls are kept; SIGTERM stops everything."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import ssl
import threading
import time

import httpx2
import openai
import pytest

from .conftest import start_proxy, stop_proxy, wait_until


@pytest.fixture(scope="module")
def workers(tmp_path_factory, upstream):
    started = start_proxy(tmp_path_factory.mktemp("workers"), upstream, "--workers", "2")
    wait_until(lambda: len(_workers(started)) == 2 and all("pid" in w for w in _workers(started)),
               timeout=30, what="both workers")
    yield started
    stop_proxy(started)


def _client(proxy, url: str | None = None) -> openai.OpenAI:
    """A client on a connection of its own: the kernel spreads new connections over the workers."""
    http = httpx2.Client(proxy=url or proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                         timeout=30)
    return openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http, max_retries=0)


def _ask(proxy, text: str, url: str | None = None, **extra):
    with _client(proxy, url) as client:
        return client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": text}], **extra)


def _workers(proxy) -> list[dict]:
    return proxy.client().health()["capture"].get("workers", [])


def _texts(proxy, where: str, params=()) -> dict[str, dict]:
    rows = proxy.store().query(f"SELECT messages_suffix, policy_version, trajectory_id FROM steps WHERE {where}", params)
    return {m["content"]: r for r in rows for m in json.loads(r["messages_suffix"] or "[]")}


def test_every_call_is_recorded_once_and_both_workers_serve(workers, marker):
    before = {w["worker"]: w["calls"] for w in _workers(workers)}
    texts = [f"spread {marker} {i}" for i in range(96)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda text: _ask(workers, text), texts))
    workers.client().barrier()  # every worker's calls committed
    rows = workers.store().query("SELECT messages_suffix FROM steps WHERE messages_suffix LIKE ?", [f"%spread {marker}%"])
    recorded = [m["content"] for r in rows for m in json.loads(r["messages_suffix"])]
    assert sorted(recorded) == sorted(texts)  # each once
    served = {w["worker"]: w["calls"] - before[w["worker"]] for w in _workers(workers)}
    assert sum(served.values()) == len(texts) and all(n > 0 for n in served.values()), served


def test_no_other_process_can_join_the_workers_port(workers):
    """An agent running as the proxy's user binds the port with SO_REUSEPORT to take a share of its
    connections (other runs' credentials, the runner's write token): the port is not open to joining."""
    import socket

    for address in (("127.0.0.1", workers.port), ("127.0.0.1", workers.control_port)):
        with socket.socket() as thief:
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                thief.bind(address)


def test_a_policy_version_set_through_either_worker_is_stamped_by_both_from_the_next_call(workers, marker):
    control = workers.client()
    for round_ in range(6):
        version = f"pv-{marker}-{round_}"
        control.set_policy_version(version)  # a connection of its own: either worker answers
        texts = [f"pv {marker} {round_} {i}" for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda text: _ask(workers, text), texts))
    control.barrier()
    stamped = _texts(workers, "messages_suffix LIKE ?", [f"%pv {marker}%"])
    assert len(stamped) == 36
    for text, row in stamped.items():
        assert row["policy_version"] == f"pv-{marker}-{text.split()[2]}", text


def test_a_run_registered_through_one_worker_is_admitted_by_the_other_from_its_first_call(workers, marker):
    control = workers.client()
    for i in range(8):
        tid = f"run-{marker}-{i}"
        control.start_trajectory(trajectory_id=tid, group_id=f"grp-{marker}", channel="train")
        run = control.register_run(tid)
        _ask(workers, f"first {marker} {i}", run["proxy_url"])  # at once, on a new connection: either worker
        # ... and a forged tag for it is refused by whichever worker takes it
        with pytest.raises(openai.PermissionDeniedError):
            _ask(workers, f"forged {marker} {i}", f"http://{tid}@127.0.0.1:{workers.port}")
    control.barrier()
    admitted = _texts(workers, "trajectory_id LIKE ?", [f"run-{marker}-%"])
    assert {text: row["trajectory_id"] for text, row in admitted.items()} == {
        f"first {marker} {i}": f"run-{marker}-{i}" for i in range(8)}


def test_the_barrier_waits_for_calls_in_flight_on_every_worker(workers, upstream, marker):
    gate = f"gated-stream-{marker}"
    texts: list[str] = []
    errors: list[Exception] = []

    def stream(text: str):
        try:
            with _client(workers) as client:
                for _ in client.chat.completions.create(model=gate, stream=True,
                                                        messages=[{"role": "user", "content": text}]):
                    pass
        except Exception as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = []
    try:
        # Streams held open upstream until both workers have some in flight.
        while len(threads) < 40 and not (
                len(threads) >= 2 and all(w["in_flight"] > 0 for w in _workers(workers))):
            texts.append(f"held {marker} {len(threads)}")
            threads.append(threading.Thread(target=stream, args=(texts[-1],)))
            threads[-1].start()
            time.sleep(0.15)
        assert all(w["in_flight"] > 0 for w in _workers(workers)), _workers(workers)
        answer: dict = {}
        barrier = threading.Thread(target=lambda: answer.update(workers.client().barrier()))
        barrier.start()
        barrier.join(1.0)
        assert barrier.is_alive(), f"the barrier returned with calls in flight: {answer}"
    finally:
        upstream.release(gate)
        for thread in threads:
            thread.join(30)
    barrier.join(30)
    assert answer["committed"] is True and answer["workers"] == 2, answer
    assert not errors
    assert set(_texts(workers, "messages_suffix LIKE ?", [f"%held {marker}%"])) == set(texts)  # no wait: committed


def test_kill_9_of_a_worker_keeps_its_finished_calls_and_sigterm_stops_everything(tmp_path, upstream, marker):
    proxy = start_proxy(tmp_path, upstream, "--workers", "2", "--set", "stepmill_writer_priority=normal")
    try:
        wait_until(lambda: len(_workers(proxy)) == 2, timeout=30, what="both workers")
        texts = [f"kept {marker} {i}" for i in range(48)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda text: _ask(proxy, text), texts))
        victim = max(_workers(proxy), key=lambda w: w["calls"])  # it served some of them
        assert victim["calls"] > 0
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: victim["pid"] not in {w.get("pid") for w in _workers(proxy)}
                   and all("pid" in w for w in _workers(proxy)), timeout=30, what="the worker started again")
        wait_until(lambda: len(_texts(proxy, "messages_suffix LIKE ?", [f"%kept {marker}%"])) == len(texts),
                   timeout=30, what="every finished call, the killed worker's replayed")
        assert "exited with -9; starting it again" in proxy.log.read_text()
        _ask(proxy, f"after {marker}")  # still serving
        pids = [w["pid"] for w in _workers(proxy)]
        writers = _children(pids)
        assert len(writers) == 2, writers
    finally:
        stop_proxy(proxy)  # SIGTERM to the supervisor
    assert proxy.process.returncode == 0
    for pid in pids + writers:
        assert not _alive(pid), f"process {pid} outlived the proxy"
    assert not list((proxy.db.parent / "steps.db.journal").glob("*/*.seg")), "every journal committed and removed"


def _children(pids: list[int]) -> list[int]:
    """The writer processes of the workers ``pids``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid in pids:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _open_fresh(path: str, start: float) -> None:
    from stepmill.store import Store

    while time.time() < start:  # every process opens at the same moment
        time.sleep(0.001)
    Store(path).close()


def test_processes_opening_a_new_file_at_once_all_get_it(tmp_path):
    """Workers start together on a file nobody made yet: each opens it (one sets it up, the others wait)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    for attempt in range(3):
        path = str(tmp_path / f"fresh-{attempt}.db")
        start = time.time() + 2.0
        processes = [context.Process(target=_open_fresh, args=(path, start)) for _ in range(6)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        assert [p.exitcode for p in processes] == [0] * 6
