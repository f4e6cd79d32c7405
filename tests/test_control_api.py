"""The control API end to end: the Python client, and raw HTTP as curl would send it."""

import http.client
import time
import subprocess
import json

import openai
import pytest

from stepmill.client import ControlError, StepmillClient

from .conftest import STEPMILL


@pytest.fixture(params=["through-proxy", "control-port"])
def client(request, proxy):
    # The token comes from the proxy's confdir, where a trainer on the same machine finds it.
    if request.param == "through-proxy":
        return proxy.client()  # http://stepmill.local, no DNS: the proxy answers
    return StepmillClient(f"http://127.0.0.1:{proxy.control_port}", confdir=str(proxy.confdir))


def test_health_and_stats(client):
    assert client.health()["ok"] is True
    assert "steps" in client.stats()


def test_white_box_trajectory(client, proxy, marker):
    run = client.start_trajectory(trajectory_id=f"wb-{marker}", group_id=f"g-{marker}", metadata={"task": "sum"})
    assert run["trajectory_id"] == f"wb-{marker}" and run["group_id"] == f"g-{marker}"
    first = client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3], response_ids=[4, 5],
                               logprobs=[-0.5, -0.25], policy_version=7, metadata={"turn": 0})
    assert first["step_index"] == 0 and first["consistency"] == "root"
    second = client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3, 4, 5, 9], response_ids=[6],
                                logprobs=[-1.0], reward=0.5)
    assert second["parent_step_id"] == first["step_id"] and second["consistency"] == "consistent"
    third = client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[1, 2, 3, 4, 7, 9, 6, 8],
                               response_ids=[10], is_last=True)
    assert third["consistency"] == "divergent" and third["divergence_pos"] == 4
    assert client.trajectory(run["trajectory_id"])["status"] == "complete"
    done = client.complete_trajectory(run["trajectory_id"], reward=1.0)
    assert done["reward"] == 1.0 and done["step_count"] == 3
    step = client.step(second["step_id"])
    assert step["prompt_ids"] == [1, 2, 3, 4, 5, 9] and step["logprobs"] == [-1.0]
    assert step["reward"] == 0.5 and step["token_provenance"] == "exact"
    assert client.step(first["step_id"])["policy_version"] == "7"
    assert client.step(third["step_id"])["reward"] == 1.0  # the trajectory's reward where the step has none
    updated = client.update_trajectory(run["trajectory_id"], channel="eval", metadata={"note": "x"})
    assert updated["channel"] == "eval" and updated["metadata"] == {"task": "sum", "note": "x"}


def test_started_trajectory_urls_tag_agent_calls(proxy, marker):
    client = proxy.client()
    run = client.start_trajectory(group_id=f"urls-{marker}")
    agent = openai.OpenAI(api_key="sk-x", base_url=run["base_url"] + "/v1", max_retries=0)
    agent.chat.completions.create(model="qwen-test", messages=[{"role": "user", "content": f"via base_url {marker}"}])
    assert run["proxy_url"] == f"http://{run['trajectory_id']}:urls-{marker}@127.0.0.1:{proxy.port}"
    [step] = proxy.trajectory_steps(run["trajectory_id"], 1)
    assert step["group_id"] == f"urls-{marker}"


def test_policy_version_is_stamped_on_captured_steps(proxy, openai_client, marker):
    client = proxy.client()
    client.set_policy_version(f"v-{marker}")
    assert client.policy_version() == f"v-{marker}"
    openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"pv {marker}"}])
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["policy_version"] == f"v-{marker}"


def test_a_version_set_from_a_past_moment_stamps_the_calls_started_since(proxy, openai_client, marker):
    """A trainer pauses its engine, swaps the weights, then sets the new version from the pause: a call
    that started after the pause (held by the engine, served by the new weights) carries the new version."""
    client = proxy.client()
    client.set_policy_version(f"old-{marker}")
    paused_at = time.time()
    gate = f"gated-stream-held-{marker}"  # the engine holds the call until the new weights are in
    stream = openai_client.chat.completions.create(model=gate, messages=[{"role": "user", "content": f"held {marker}"}],
                                                   stream=True)
    chunks = iter(stream)
    next(chunks)
    client.set_policy_version(f"new-{marker}", since=paused_at)
    proxy.upstream.release(gate)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"Echo: held {marker}"
    [step] = proxy.steps("s.model = ?", [gate])
    assert step["policy_version"] == f"new-{marker}"
    with pytest.raises(ControlError, match="already past"):
        client.set_policy_version("later", since=time.time() + 60)


def test_a_submitted_step_is_stamped_with_the_version_in_force_when_its_generation_began(proxy, marker):
    client = proxy.client()
    client.set_policy_version(f"before-{marker}")
    began = time.time()
    client.set_policy_version(f"after-{marker}")
    first = client.submit_step(trajectory_id=f"wb-{marker}", prompt_ids=[1, 2], response_ids=[3], started_at=began)
    second = client.submit_step(trajectory_id=f"wb-{marker}", prompt_ids=[1, 2, 3, 4], response_ids=[5])
    assert client.step(first["step_id"])["policy_version"] == f"before-{marker}"
    assert client.step(second["step_id"])["policy_version"] == f"after-{marker}"
    with pytest.raises(ControlError, match="already past"):
        client.submit_step(trajectory_id=f"wb-{marker}", prompt_ids=[1], response_ids=[2], started_at=time.time() + 60)


PROXY_TOKEN = object()


def _raw(proxy, method, path, body: bytes | None = None, *, token=PROXY_TOKEN):
    """What curl does: one plain HTTP request to the control port (with the proxy's token by default)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.control_port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {proxy.token if token is PROXY_TOKEN else token}"
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize("method,path,body,status,message", [
    ("POST", "/v1/steps", b'{"prompt_ids": [1,', 400, "not valid JSON"),
    ("POST", "/v1/steps", b'[1, 2]', 400, "JSON object"),
    ("POST", "/v1/steps", b'{"response_ids": [1]}', 400, "'prompt_ids' is required"),
    ("POST", "/v1/steps", b'{"prompt_ids": [1], "response_ids": ["a"]}', 400, "token ids"),
    ("POST", "/v1/steps", b'{"prompt_ids": [1], "response_ids": [2, 3], "logprobs": [-1]}', 400, "logprobs has 1"),
    ("POST", "/v1/steps", b'{"prompt_ids": [1], "response_ids": [2], "rewrd": 1}', 400, "unknown field 'rewrd'"),
    ("POST", "/v1/steps", b'{"prompt_ids": [1], "response_ids": [2], "parent_step_id": "nope"}', 400, "not a recorded step"),
    ("POST", "/v1/steps", b'{"prompt_ids": [1], "response_ids": [2], "reward": "high"}', 400, "must be a number"),
    ("POST", "/v1/trajectories/nope/complete", b'{}', 404, "no trajectory"),
    ("PATCH", "/v1/trajectories/nope", b'{"channel": "x"}', 404, "no trajectory"),
    ("PUT", "/v1/policy_version", b'{}', 400, "'policy_version' is required"),
    ("DELETE", "/v1/steps", None, 405, "use POST"),
    ("GET", "/v1/nothing", None, 404, "no control endpoint"),
    ("GET", "/v1/steps/nope", None, 404, "not found"),
])
def test_bad_requests_get_clear_errors_and_write_nothing(proxy, method, path, body, status, message):
    before = proxy.store().stats()["steps"]
    got_status, payload = _raw(proxy, method, path, body)
    assert got_status == status and message in payload["error"]
    assert proxy.store().stats()["steps"] == before


def test_duplicate_trajectory_conflicts(proxy, marker):
    client = StepmillClient(f"http://127.0.0.1:{proxy.control_port}", token=proxy.token)
    client.start_trajectory(trajectory_id=f"dup-{marker}")
    with pytest.raises(ControlError) as error:
        client.start_trajectory(trajectory_id=f"dup-{marker}")
    assert error.value.status == 409 and "already exists" in error.value.message


def test_raw_http_submission(proxy, marker):
    status, created = _raw(proxy, "POST", "/v1/trajectories", json.dumps({"trajectory_id": f"raw-{marker}"}).encode())
    assert status == 201
    status, step = _raw(proxy, "POST", "/v1/steps", json.dumps(
        {"trajectory_id": f"raw-{marker}", "prompt_ids": [5, 6], "response_ids": [7], "logprobs": [-0.1]}).encode())
    assert status == 201 and step["trajectory_id"] == f"raw-{marker}"
    status, record = _raw(proxy, "GET", f"/v1/steps/{step['step_id']}")
    assert record["prompt_ids"] == [5, 6] and record["response_ids"] == [7]


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/steps", b'{"prompt_ids": [1], "response_ids": [2], "reward": 1.0}'),
    ("PUT", "/v1/policy_version", b'{"policy_version": "evil"}'),
    ("POST", "/v1/trajectories", b'{}'),
    ("GET", "/v1/stats", None),
])
@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_writes_and_reads_need_the_token(proxy, method, path, body, token):
    before = proxy.store().stats()
    status, payload = _raw(proxy, method, path, body, token=token)
    assert status == 401 and "write token" in payload["error"]
    after = proxy.store().stats()
    assert after["steps"] == before["steps"] and after["policy_version"] == before["policy_version"]
    assert _raw(proxy, "GET", "/v1/health", token=token)[0] == 200  # anonymous callers get health only


def test_an_agent_cannot_reach_the_control_api_through_llm_hosts(proxy, marker):
    """An agent has the proxy's address (and its own trajectory id): no host or port but the control
    ones answers, and those need the token the agent never gets."""
    import httpx2
    import ssl

    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    with httpx2.Client(proxy=proxy.url, verify=verify, timeout=10) as agent:
        for url in ("https://api.openai.com/_stepmill/v1/policy_version", "http://stepmill.local/v1/policy_version"):
            response = agent.put(url, json={"policy_version": f"agent-{marker}"})
            assert response.status_code in (401, 404, 405, 502), url
    reverse = httpx2.put(f"http://127.0.0.1:{proxy.reverse_port}/_stepmill/v1/policy_version",
                         json={"policy_version": f"agent-{marker}"}, timeout=10)
    assert reverse.status_code != 200
    assert proxy.client().policy_version() != f"agent-{marker}"
    env = subprocess.run(STEPMILL + ["env", "--port", str(proxy.port), "--confdir", str(proxy.confdir)],
                         capture_output=True, text=True, check=True).stdout
    assert proxy.token not in env  # what agents are given holds no token


def test_token_file_is_owner_only(proxy):
    import stat

    mode = stat.S_IMODE((proxy.confdir / "stepmill-token").stat().st_mode)
    assert mode == 0o600 and len(proxy.token) >= 32


@pytest.mark.parametrize("body,message", [
    (b'{"prompt_ids": [1], "response_ids": [2], "reward": NaN}', "not a number JSON allows"),
    (b'{"prompt_ids": [1], "response_ids": [2], "reward": Infinity}', "not a number JSON allows"),
    (b'{"prompt_ids": [1], "response_ids": [2], "reward": 1e999}', "must be a number"),
    (b'{"prompt_ids": [1], "response_ids": [2], "step_index": 1180591620717411303424}', "below 2^63"),
    (b'{"prompt_ids": [1], "response_ids": [2], "metadata": {"n": 1180591620717411303424}}', "must be an object"),
    (b'{"prompt_ids": [1], "response_ids": [2], "trajectory_id": "\\ud800"}', "must be a non-empty string"),
    (b'{"prompt_ids": [1], "response_ids": [2], "metadata": {"x": "\\udfff"}}', "must be an object"),
    (b'{"a":' * 5000 + b'1' + b'}' * 5000, "nested too deeply"),
])
def test_edge_cases_are_4xx_never_a_proxy_error_page(proxy, body, message):
    status, payload = _raw(proxy, "POST", "/v1/steps", body)
    assert status == 400 and message in payload["error"], payload


def test_ids_with_odd_characters_round_trip(proxy, marker):
    client = proxy.client()
    for odd in (f"with space {marker}", f"slash/{marker}", f"q?{marker}", f"é-{marker}", f"pct%2F{marker}"):
        run = client.start_trajectory(trajectory_id=odd)
        assert run["trajectory_id"] == odd
        assert client.trajectory(odd)["id"] == odd
        assert client.complete_trajectory(odd, reward=0.5)["reward"] == 0.5
    status, payload = _raw(proxy, "GET", "/v1/trajectories/%ED%A0%80")
    assert status == 400 and "UTF-8" in payload["error"]


def _in_process(tmp_path):
    """The control API without a proxy: calls answered by ``handle`` directly."""
    from stepmill.api.control import ControlAPI
    from stepmill.store import Store

    return ControlAPI(Store(tmp_path / "control.db"), token="t0ken")


def test_a_keyerror_from_a_bug_is_a_500_not_a_404(tmp_path, monkeypatch):
    api = _in_process(tmp_path)
    auth = "Bearer t0ken"
    status, created = api.handle("POST", "/v1/trajectories", b'{"trajectory_id": "bug"}', authorization=auth)
    assert status == 201

    def broken(*args, **kwargs):
        return {}["missing column"]  # a bug's KeyError, not a missing trajectory

    monkeypatch.setattr(api.store, "trajectory", broken)
    status, payload = api.handle("GET", "/v1/trajectories/bug", b"", authorization=auth)
    assert status == 500 and "KeyError" in payload["error"], payload
    monkeypatch.setattr(api.store, "step", broken)
    status, payload = api.handle("GET", "/v1/steps/anything", b"", authorization=auth)
    assert status == 500 and "KeyError" in payload["error"], payload
    monkeypatch.undo()
    status, payload = api.handle("GET", "/v1/steps/nope", b"", authorization=auth)  # really missing
    assert (status, payload) == (404, {"error": "not found: nope"})
    status, payload = api.handle("GET", "/v1/trajectories/nope", b"", authorization=auth)
    assert (status, payload) == (404, {"error": "no trajectory 'nope'"})


def test_a_duplicate_trajectory_is_a_conflict(tmp_path):
    from stepmill.errors import Conflict

    api = _in_process(tmp_path)
    body = b'{"trajectory_id": "twice"}'
    assert api.handle("POST", "/v1/trajectories", body, authorization="Bearer t0ken")[0] == 201
    with pytest.raises(Conflict):
        api.store.start_trajectory(trajectory_id="twice")
    status, payload = api.handle("POST", "/v1/trajectories", body, authorization="Bearer t0ken")
    assert (status, payload) == (409, {"error": "trajectory 'twice' already exists"})


def test_the_barrier_waits_on_the_route_tables_paths(tmp_path):
    api = _in_process(tmp_path)
    auth = "Bearer t0ken"
    assert api.barrier_target("POST", "/v1/barrier/", auth) is None
    assert api.barrier_target("POST", "/v1/trajectories/a%2Fb/complete?x=1", auth) == "a/b"
    assert api.barrier_target("POST", "/v1/trajectories/%ED%A0%80/complete", auth) is False
    assert api.barrier_target("POST", "/v1/trajectories/a/complete", "Bearer wrong") is False
    assert api.barrier_target("GET", "/v1/barrier", auth) is False
    assert api.barrier_target("POST", "/v1/steps", auth) is False
