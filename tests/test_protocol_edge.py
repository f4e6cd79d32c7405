"""The protocol edge answers for itself: a Gemini or Messages call the proxy cannot translate for an engine
gets the proxy's own 400 in the agent's protocol and never reaches the engine; an engine's refusal comes back
in the agent's protocol with the engine's message; the key an agent sends its protocol's way reaches an engine
that checks keys. The engine is the test upstream made to check a key as vLLM started with --api-key does
(every route, ``Authorization: Bearer`` only)."""

import uuid

import httpx2 as httpx
import pytest

from .conftest import launch_proxy, stop_proxy
from .upstream import TOO_LONG, Upstream

KEY = "sk-engine-key"
GEMINI = "/v1beta/models/{model}:generateContent"
BEARER = {"Authorization": f"Bearer {KEY}"}  # the engine's own way: the tests of the other points need no carried key


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Upstream:
    """An engine that checks keys."""
    started = Upstream(tmp_path_factory.mktemp("keyed-engine")).start()
    started.api_key = KEY
    return started


def proxy_in_front(tmp, engine: Upstream):
    return launch_proxy(tmp, f"https://127.0.0.1:{engine.port}", "--set", f"ssl_verify_upstream_trusted_ca={engine.ca}",
                        "--set", "termlog_verbosity=warn")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, engine):
    """A proxy in front of the engine that checks keys: (proxy, engine)."""
    proxy = proxy_in_front(tmp_path_factory.mktemp("edge-proxy"), engine)
    yield proxy, engine
    stop_proxy(proxy)


@pytest.fixture
def fresh(tmp_path, engine):
    """A proxy of its own, whose first call to the engine probes it: the key must reach the probe too."""
    proxy = proxy_in_front(tmp_path, engine)
    yield proxy, engine
    stop_proxy(proxy)


def post(proxy, path: str, *, raw: bytes, headers: dict) -> httpx.Response:
    with httpx.Client(timeout=30, trust_env=False) as client:
        return client.post(f"http://127.0.0.1:{proxy.reverse_port}{path}", content=raw,
                           headers={"Content-Type": "application/json", **headers})


def reached_engine(engine: Upstream, marker: str) -> bool:
    return any(marker in str(body) for body in engine.requests)


def gemini_body(marker: str) -> bytes:
    return f'{{"contents": [{{"role": "user", "parts": [{{"text": "[{marker}] say hi"}}]}}]}}'.encode()


def messages_body(marker: str, model: str = "m") -> bytes:
    return (f'{{"model": "{model}", "max_tokens": 64, '
            f'"messages": [{{"role": "user", "content": "[{marker}] say hi"}}]}}').encode()


@pytest.mark.parametrize("case", ["not json", "wrong shape"])
def test_a_gemini_call_that_cannot_be_translated_gets_the_proxys_400_and_never_reaches_the_engine(keyed, case):
    proxy, engine = keyed
    marker = uuid.uuid4().hex
    raw = {"not json": f'{{"contents": [{{"parts": [{{"text": "{marker}"'.encode(),  # cut short
           "wrong shape": f'{{"contents": ["{marker}"]}}'.encode()}[case]
    answer = post(proxy, GEMINI.format(model="m"), raw=raw,
                  headers={**BEARER, "x-stepmill-trajectory": marker})
    assert answer.status_code == 400, answer.text  # before: the engine's route-less answer
    error = answer.json()["error"]
    assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    assert error["message"].startswith("stepmill refused this call")
    assert ("not JSON" if case == "not json" else "contents[0] is not an object") in error["message"]
    assert not reached_engine(engine, marker)  # never forwarded to a route the engine does not have
    [step] = proxy.steps("s.trajectory_id = ?", [marker])  # stored once, as refused
    assert step["api"] == "gemini.generate" and step["status"] == "error"
    assert "stepmill refused this call" in step["error"]


@pytest.mark.parametrize("case", ["not json", "wrong shape"])
def test_a_messages_call_that_cannot_be_translated_gets_the_proxys_400_in_messages_shape(keyed, case):
    proxy, engine = keyed
    marker = uuid.uuid4().hex
    raw = {"not json": f'{{"model": "m", "messages": [{{"content": "{marker}"'.encode(),
           "wrong shape": f'{{"model": "m", "max_tokens": 9, "messages": "{marker}"}}'.encode()}[case]
    answer = post(proxy, "/v1/messages", raw=raw, headers={**BEARER, "x-stepmill-trajectory": marker})
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("stepmill refused this call")
    assert ("not JSON" if case == "not json" else "'messages' is not a list") in body["error"]["message"]
    assert not reached_engine(engine, marker)
    [step] = proxy.steps("s.trajectory_id = ?", [marker])
    assert step["api"] == "anthropic.messages" and step["status"] == "error"


@pytest.mark.parametrize("sent_as", ["x-goog-api-key", "?key="])
def test_a_gemini_key_reaches_an_engine_that_checks_keys(fresh, sent_as):
    """Before: the probe and the translated call carried no Authorization, the engine answered 401."""
    proxy, engine = fresh
    marker = uuid.uuid4().hex
    path = GEMINI.format(model="m") + (f"?key={KEY}" if sent_as == "?key=" else "")
    headers = {"x-goog-api-key": KEY} if sent_as == "x-goog-api-key" else {}
    answer = post(proxy, path, raw=gemini_body(marker), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["candidates"][0]["finishReason"] == "STOP"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert (step["api"], step["engine_api"], step["token_provenance"]) == ("gemini.generate", "openai.chat", "exact")
    assert KEY not in str(step)  # the key is carried, never written


def test_a_messages_key_reaches_an_engine_that_checks_keys(fresh):
    proxy, engine = fresh
    marker = uuid.uuid4().hex
    answer = post(proxy, "/v1/messages", raw=messages_body(marker), headers={"x-api-key": KEY})
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message"
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert (step["api"], step["engine_api"], step["token_provenance"]) == (
        "anthropic.messages", "openai.chat", "exact")


@pytest.mark.parametrize("model, status, gemini_status, messages_type, message", [
    ("too-long", 400, "INVALID_ARGUMENT", "invalid_request_error", TOO_LONG),
    ("http-500", 500, "INTERNAL", "api_error", "upstream exploded")])
def test_an_engines_refusal_reaches_the_agent_in_its_protocol_with_the_engines_message(
        keyed, model, status, gemini_status, messages_type, message):
    """What the CLI prints: the engine's message in the agent's error shape, its code the engine's status
    (before: every refusal said 400 INVALID_ARGUMENT / invalid_request_error, a 500 too)."""
    proxy, _ = keyed
    marker = uuid.uuid4().hex
    gemini = post(proxy, GEMINI.format(model=model), raw=gemini_body(marker), headers=BEARER)
    assert gemini.status_code == status
    assert gemini.json() == {"error": {"code": status, "message": message, "status": gemini_status}}
    messages = post(proxy, "/v1/messages", raw=messages_body(marker, model), headers=BEARER)
    assert messages.status_code == status
    assert messages.json() == {"type": "error", "error": {"type": messages_type, "message": message}}
