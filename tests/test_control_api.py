"""The control API end to end: the Python client, and raw HTTP as curl would send it."""

import http.client
import json

import openai
import pytest

from stepmill.client import ControlError, StepmillClient

from .conftest import http_json


@pytest.fixture(params=["through-proxy", "control-port", "reverse-path"])
def client(request, proxy):
    if request.param == "through-proxy":
        return StepmillClient(proxy=proxy.url)  # http://stepmill.local, no DNS: the proxy answers
    if request.param == "control-port":
        return StepmillClient(f"http://127.0.0.1:{proxy.control_port}")
    return StepmillClient(f"http://127.0.0.1:{proxy.reverse_port}/_stepmill")


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
    client = StepmillClient(proxy=proxy.url)
    run = client.start_trajectory(group_id=f"urls-{marker}")
    agent = openai.OpenAI(api_key="sk-x", base_url=run["base_url"] + "/v1", max_retries=0)
    agent.chat.completions.create(model="qwen-test", messages=[{"role": "user", "content": f"via base_url {marker}"}])
    assert run["proxy_url"] == f"http://{run['trajectory_id']}:urls-{marker}@127.0.0.1:{proxy.port}"
    [step] = proxy.trajectory_steps(run["trajectory_id"], 1)
    assert step["group_id"] == f"urls-{marker}"


def test_policy_version_is_stamped_on_captured_steps(proxy, openai_client, marker):
    client = StepmillClient(proxy=proxy.url)
    client.set_policy_version(f"v-{marker}")
    assert client.policy_version() == f"v-{marker}"
    openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"pv {marker}"}])
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["policy_version"] == f"v-{marker}"


def _raw(proxy, method, path, body: bytes | None = None):
    """What curl does: one plain HTTP request to the control port."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.control_port, timeout=10)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
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
    client = StepmillClient(f"http://127.0.0.1:{proxy.control_port}")
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
    status, record = http_json("GET", f"http://127.0.0.1:{proxy.control_port}/v1/steps/{step['step_id']}")
    assert record["prompt_ids"] == [5, 6] and record["response_ids"] == [7]
