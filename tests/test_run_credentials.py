"""Per-run credentials through the real proxy: a registered run is written only with its secret; tag
headers never override credentials; intruders are refused with a clear 403 and no step; completing a
trajectory waits until its calls are committed; anonymous health says nothing but ok."""

import hashlib
import json
import sqlite3
import ssl
import threading
import time

import httpx2
import openai
import pytest

from .conftest import http_json


def _client(proxy, url: str, **headers) -> openai.OpenAI:
    http_client = httpx2.Client(proxy=url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                                headers=headers)
    return openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http_client, max_retries=0)


def _registered(proxy, marker, name: str) -> dict:
    client = proxy.client()
    client.start_trajectory(trajectory_id=f"{name}-{marker}", group_id=f"grp-{marker}", channel="train")
    return client.register_run(f"{name}-{marker}")


def _ask(client, text: str):
    return client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": text}])


def test_a_registered_run_is_written_only_with_its_secret(proxy, marker):
    run = _registered(proxy, marker, "run")
    other = _registered(proxy, marker, "other")
    assert run["proxy_url"].startswith(f"http://run-{marker}:{run['secret']}@")
    assert run["base_url"].endswith(f"/t/run-{marker}/k/{run['secret']}")
    _ask(_client(proxy, run["proxy_url"]), f"mine {marker}")  # the run's own credentials: recorded
    [step] = proxy.trajectory_steps(f"run-{marker}", 1)
    assert step["group_id"] == f"grp-{marker}" and step["channel"] == "train"

    host = f"127.0.0.1:{proxy.port}"
    attempts = {
        "no secret": f"http://other-{marker}@{host}",
        "the group as password": f"http://other-{marker}:grp-{marker}@{host}",
        "another run's secret": f"http://other-{marker}:{run['secret']}@{host}",
        "an intruder in a registered group": f"http://intruder-{marker}:grp-{marker}@{host}",
    }
    for what, url in attempts.items():
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _ask(_client(proxy, url), f"{what} {marker}")
        assert refused.value.body["type"] == "stepmill_refused", what
    # Tag headers never override credentials, and never name a registered run on their own.
    _ask(_client(proxy, run["proxy_url"], **{"X-Stepmill-Trajectory": f"other-{marker}", "X-Stepmill-Channel": "x"}),
         f"header on top {marker}")
    with pytest.raises(openai.PermissionDeniedError, match="not tag headers"):
        _ask(_client(proxy, f"http://{host}", **{"X-Stepmill-Trajectory": f"other-{marker}"}), f"hdr {marker}")
    # The reverse listener takes the same secret in its path.
    reverse = openai.OpenAI(api_key="sk-x", max_retries=0,
                            base_url=f"http://127.0.0.1:{proxy.reverse_port}/t/other-{marker}/k/{other['secret']}/v1")
    _ask(reverse, f"reverse {marker}")
    with pytest.raises(openai.PermissionDeniedError):
        _ask(openai.OpenAI(api_key="sk-x", max_retries=0, base_url=f"http://127.0.0.1:{proxy.reverse_port}"
                           f"/t/other-{marker}/g/grp-{marker}/v1"), f"reverse group {marker}")

    assert len(proxy.trajectory_steps(f"run-{marker}", 2)) == 2
    [mine] = proxy.trajectory_steps(f"other-{marker}", 1)
    assert "reverse" in json.dumps(mine["messages"])
    store = proxy.store()
    assert store.query("SELECT count(*) AS n FROM trajectories WHERE id = ?", [f"intruder-{marker}"])[0]["n"] == 0
    assert store.query("SELECT DISTINCT channel FROM steps WHERE group_id = ?", [f"grp-{marker}"]) == [{"channel": "train"}]
    log = proxy.log.read_text()
    assert f"stepmill: refused POST api.openai.com/v1/chat/completions: trajectory 'other-{marker}' is a registered run" in log
    assert f"group 'grp-{marker}' belongs to registered runs" in log


def test_a_rerun_gets_a_new_secret_and_the_old_one_stops_working(proxy, marker):
    first = _registered(proxy, marker, "again")
    second = proxy.client().register_run(f"again-{marker}")
    assert second["secret"] != first["secret"]
    with pytest.raises(openai.PermissionDeniedError):
        _ask(_client(proxy, first["proxy_url"]), f"old {marker}")
    _ask(_client(proxy, second["proxy_url"]), f"new {marker}")


def test_a_session_id_cannot_name_a_registered_run(proxy, openai_client, marker):
    _registered(proxy, marker, "sess")
    openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"s {marker}"}],
                                          extra_headers={"x-session-id": f"sess-{marker}"})
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%s {marker}%"])
    assert step["trajectory_id"] != f"sess-{marker}"


def test_anonymous_health_says_only_that_the_proxy_is_alive(proxy):
    status, body = http_json("GET", "http://stepmill.local/v1/health", proxy=proxy.url)
    assert (status, body) == (200, {"ok": True})
    full = proxy.client().health()
    assert full["db"] == str(proxy.db) and "capture" in full


def test_complete_waits_until_the_runs_calls_are_committed(proxy, marker):
    """A trajectory completed while the database is locked: complete answers only once the writer
    committed the run's last call, so a reward computed next sees it."""
    run = _registered(proxy, marker, "barrier")
    client = _client(proxy, run["proxy_url"])
    _ask(client, f"first {marker}")
    proxy.trajectory_steps(f"barrier-{marker}", 1)
    lock = sqlite3.connect(proxy.db, timeout=30, check_same_thread=False)
    lock.execute("BEGIN IMMEDIATE")  # the writer cannot commit until this ends
    release = threading.Timer(2.0, lock.rollback)
    try:
        _ask(client, f"last {marker}")
        release.start()
        started = time.monotonic()
        done = proxy.client().complete_trajectory(f"barrier-{marker}")
        waited = time.monotonic() - started
    finally:
        release.join()
        lock.close()
    assert done["barrier"]["committed"] is True and waited > 1.0, (done, waited)
    store = proxy.store()
    assert store.query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?", [f"barrier-{marker}"])[0]["n"] == 2
    assert proxy.client().barrier()["committed"] is True


def test_a_registered_run_cannot_write_beside_its_trajectory(proxy, marker):
    """The run's own credentials with a tagged path naming another trajectory: one call, two
    trajectories — refused, and the run's secret never goes upstream."""
    run = _registered(proxy, marker, "beside")
    client = _client(proxy, run["proxy_url"])
    client.base_url = "https://api.openai.com/t/hidden-{0}/v1".format(marker)
    with pytest.raises(openai.PermissionDeniedError, match="come with another trajectory"):
        _ask(client, f"beside {marker}")
    assert proxy.store().trajectory(f"hidden-{marker}") is None


def test_a_group_squatted_before_its_runs_register_is_given_back(proxy, openai_client, marker):
    """A trajectory nobody registered, written into a group before its runs were registered, would keep
    the group open for ever: registering a run of the group moves it to a group of its own."""
    openai_client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": f"squat {marker}"}],
        extra_headers={"X-Stepmill-Trajectory": f"squat-{marker}", "X-Stepmill-Group": f"grp-{marker}"})
    proxy.trajectory_steps(f"squat-{marker}", 1)
    _registered(proxy, marker, "owner")
    store = proxy.store()
    assert store.trajectory(f"squat-{marker}")["group_id"] == f"grp-{marker}~unregistered"
    assert {r["id"] for r in store.query("SELECT id FROM trajectories WHERE group_id = ?", [f"grp-{marker}"])} == \
        {f"owner-{marker}"}


def test_a_revoked_secret_writes_nothing(proxy, marker):
    """A run's secret dies with the run: revoked (or its trajectory completed), its credentials are
    refused with a 403 that says so, and nothing is written."""
    run = _registered(proxy, marker, "ended")
    client = _client(proxy, run["proxy_url"])
    _ask(client, f"while running {marker}")
    proxy.trajectory_steps(f"ended-{marker}", 1)
    assert proxy.client().revoke_run(f"ended-{marker}")["revoked_at"]
    with pytest.raises(openai.PermissionDeniedError, match="has ended: its credentials were revoked"):
        _ask(client, f"after revoke {marker}")
    reverse = openai.OpenAI(api_key="sk-x", max_retries=0, base_url=f"http://127.0.0.1:{proxy.reverse_port}"
                            f"/t/ended-{marker}/k/{run['secret']}/v1")
    with pytest.raises(openai.PermissionDeniedError, match="revoked"):
        _ask(reverse, f"after revoke reverse {marker}")
    # Completing a run revokes it too, whoever completes it.
    other = _registered(proxy, marker, "completed")
    proxy.client().complete_trajectory(f"completed-{marker}")
    with pytest.raises(openai.PermissionDeniedError, match="revoked"):
        _ask(_client(proxy, other["proxy_url"]), f"after complete {marker}")
    store = proxy.store()
    assert store.query("SELECT count(*) AS n FROM steps WHERE messages_suffix LIKE ?", [f"%after % {marker}%"])[0]["n"] == 0
    assert store.query("SELECT count(*) AS n FROM steps WHERE trajectory_id = ?", [f"ended-{marker}"])[0]["n"] == 1
    # A rerun gets a new secret that works again; its earlier attempt's steps stay out of the gate.
    again = proxy.client().register_run(f"ended-{marker}")
    _ask(_client(proxy, again["proxy_url"]), f"rerun {marker}")
    proxy.trajectory_steps(f"ended-{marker}", 2)
    assert "revoked" in proxy.log.read_text()


def test_while_sandboxed_runs_are_open_a_call_from_no_door_needs_credentials_or_the_token(proxy, marker):
    """A sandboxed run's calls come through its door; while any is open, a call from anywhere else (a
    process on the host, one left behind by an unsandboxed run) writes only as a registered run or
    with the write token. Once the runs end, plain tagging works as without the runner."""
    proxy.client().start_trajectory(trajectory_id=f"boxed-{marker}", group_id=f"boxed-grp-{marker}", channel="train")
    proxy.client().register_run(f"boxed-{marker}", door=hashlib.sha256(f"door key {marker}".encode()).hexdigest())
    try:
        plain = _client(proxy, f"http://127.0.0.1:{proxy.port}", **{"X-Stepmill-Trajectory": f"outside-{marker}"})
        with pytest.raises(openai.PermissionDeniedError, match="sandboxed run.* are open: a call that comes through "
                                                               "no run's door needs"):
            _ask(plain, f"from no door {marker}")
        registered = _registered(proxy, marker, "credentialed")  # a registered run's credentials: written
        _ask(_client(proxy, registered["proxy_url"]), f"credentialed {marker}")
        proxy.trajectory_steps(f"credentialed-{marker}", 1)
        token = proxy.token
        vouched = _client(proxy, f"http://127.0.0.1:{proxy.port}", **{"X-Stepmill-Trajectory": f"vouched-{marker}",
                                                                      "X-Stepmill-Token": token})
        _ask(vouched, f"with the token {marker}")
        proxy.trajectory_steps(f"vouched-{marker}", 1)
    finally:
        proxy.client().revoke_run(f"boxed-{marker}")
    _ask(plain, f"after the runs ended {marker}")
    proxy.trajectory_steps(f"outside-{marker}", 1)
    assert proxy.store().query("SELECT count(*) AS n FROM steps WHERE messages_suffix LIKE ?",
                               [f"%from no door {marker}%"])[0]["n"] == 0


def test_a_step_that_started_after_its_trajectory_completed_is_out_of_the_gate_and_the_reward(proxy, marker):
    """Whatever still writes after a run was completed (here the control API's step submission, which
    takes any trajectory id from a holder of the write token), its steps are no part of the run."""
    from stepmill.rewards.scoring import trajectory_input

    run = _registered(proxy, marker, "late")
    _ask(_client(proxy, run["proxy_url"]), f"in time {marker}")
    proxy.trajectory_steps(f"late-{marker}", 1)
    proxy.client().complete_trajectory(f"late-{marker}")
    time.sleep(0.01)
    proxy.client().submit_step(prompt_ids=[1, 2], response_ids=[3], trajectory_id=f"late-{marker}",
                               completion={"role": "assistant", "content": f"LATE {marker}"})
    steps = proxy.trajectory_steps(f"late-{marker}", 2)
    store = proxy.store()
    counts = store.gate_counts("s.trajectory_id = ?", [f"late-{marker}"])
    assert counts == {"kept": 1, "removed": 1, "removed_by_reason": {"started after its trajectory completed": 1}}, counts
    [row] = [r for r in store.completed_trajectories(id_prefix=f"late-{marker}")]
    scored = trajectory_input(store, row)
    assert len(scored["steps"]) == 1 and f"LATE {marker}" not in json.dumps(scored), scored["steps"]
    assert len(steps) == 2
