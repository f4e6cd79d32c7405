"""Bad input never crashes the proxy: each case becomes a recorded step with a status and raw bytes."""

import json
import ssl
import threading
import time

import httpx2
import openai
import pytest


def _raw(proxy, step_id):
    return proxy.store().query("SELECT raw_request, raw_response, status, error FROM steps WHERE id = ?", [step_id])[0]


def _client(proxy):
    return httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                         timeout=30)


def test_malformed_request_json(proxy, marker):
    body = f'{{"model": "gpt-test", "messages": [{{"role": "user", "content": "{marker}"'.encode()
    with _client(proxy) as client:
        response = client.post("https://api.openai.com/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json", "X-Stepmill-Trajectory": f"bad-{marker}"})
    assert response.status_code == 400  # the client sees what the upstream sent
    [step] = proxy.trajectory_steps(f"bad-{marker}", 1)
    assert step["status"] == "error" and "not valid JSON" in step["error"]
    assert _raw(proxy, step["step_id"])["raw_request"] == body


def test_malformed_response_json(proxy, openai_client, marker):
    with pytest.raises(Exception):
        openai_client.chat.completions.create(model="bad-json", messages=[{"role": "user", "content": marker}])
    [step] = proxy.steps("s.model = 'bad-json' AND s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "error" and "not valid JSON" in step["error"]
    assert _raw(proxy, step["step_id"])["raw_response"] == b'{"id": "broken", "choices": ['


def test_upstream_error_status(proxy, openai_client, marker):
    with pytest.raises(openai.InternalServerError):
        openai_client.chat.completions.create(model="http-500", messages=[{"role": "user", "content": marker}])
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "error" and "500" in step["error"] and "upstream exploded" in step["error"]
    assert json.loads(_raw(proxy, step["step_id"])["raw_response"])["error"]["message"] == "upstream exploded"


def test_stream_cut_midway(proxy, openai_client, marker):
    received = []
    with pytest.raises(Exception):
        for chunk in openai_client.chat.completions.create(
                model="cut-stream", messages=[{"role": "user", "content": f"a long answer {marker}"}], stream=True):
            received.append(chunk.choices[0].delta.content or "")
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "incomplete"
    assert step["completion"]["content"] == "".join(received) != ""
    assert b"data:" in _raw(proxy, step["step_id"])["raw_response"]


def test_client_disconnects(proxy, openai_client, marker):
    gate = f"gated-stream-{marker}"
    stream = openai_client.chat.completions.create(model=gate, messages=[{"role": "user", "content": marker}], stream=True)
    next(iter(stream))
    stream.response.close()  # the agent goes away mid-stream
    time.sleep(0.3)
    proxy.upstream.release(gate)
    [step] = proxy.steps("s.model = ?", [gate])
    assert step["status"] == "incomplete"
    assert _raw(proxy, step["step_id"])["raw_response"]


def test_unknown_stream_event(proxy, anthropic_client, marker):
    with anthropic_client.messages.stream(model="unknown-event", max_tokens=50,
                                          messages=[{"role": "user", "content": f"x {marker}"}]) as stream:
        text = stream.get_final_text()
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "error" and "mystery_event" in step["error"]
    assert step["completion"]["content"] == text  # what did parse is kept
    assert b"mystery_event" in _raw(proxy, step["step_id"])["raw_response"]


def test_websocket_closed_early(proxy, openai_client, marker):
    with openai_client.responses.connect(max_retries=0) as connection:
        connection.response.create(model="ws-close", input=f"go {marker}")
        with pytest.raises(Exception):
            for _ in connection:
                pass
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%{marker}%"])
    assert step["status"] == "incomplete" and "closed" in step["error"]
    assert step["transport"] == "websocket"


def test_proxy_keeps_serving(proxy, openai_client, marker):
    reply = openai_client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": marker}])
    assert reply.choices[0].message.content == f"Echo: {marker}"
    assert proxy.process.poll() is None


def test_first_event_arrives_before_the_upstream_sends_the_last(proxy, openai_client, marker):
    gate = f"gated-stream-ok-{marker}"
    released = threading.Event()
    safety = threading.Timer(10, lambda: (released.set(), proxy.upstream.release(gate)))
    safety.start()
    stream = openai_client.chat.completions.create(model=gate, messages=[{"role": "user", "content": marker}], stream=True)
    chunks = iter(stream)
    next(chunks)  # the upstream holds everything after its first event until released
    first_before_release = not released.is_set()
    released.set()
    proxy.upstream.release(gate)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    safety.cancel()
    assert first_before_release, "the proxy buffered the stream instead of passing it through"
    assert text == f"Echo: {marker}"
    [step] = proxy.steps("s.model = ?", [gate])
    assert step["status"] == "ok" and step["completion"]["content"] == text


def test_too_deep_to_parse_keeps_its_trajectory(proxy, marker):
    """The tags come from the flow, not the parse: a request nested past any parser's depth is an error step
    of the trajectory it was tagged with (a header here, proxy credentials alike)."""
    body = b'{"model": "gpt-test", "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    with _client(proxy) as client:
        client.post("https://api.openai.com/v1/chat/completions", content=body,
                    headers={"Content-Type": "application/json", "X-Stepmill-Trajectory": f"deep-{marker}",
                             "X-Stepmill-Group": f"deep-group-{marker}"})
    [step] = proxy.trajectory_steps(f"deep-{marker}", 1)
    assert step["status"] == "error" and "nested too deeply" in step["error"]
    assert step["group_id"] == f"deep-group-{marker}"
    assert _raw(proxy, step["step_id"])["raw_request"] == body


@pytest.mark.parametrize("kind", ["failure", "http"])
def test_every_fallback_keeps_the_flows_tags(tmp_path, kind):
    """A hook that failed (``failure``) and a call the writer could not read at all (an api it has no
    parser for) are bare error steps, still of the trajectory and group the flow was tagged with."""
    from stepmill.pipeline.call_record import Call, CallRecord
    from stepmill.pipeline.ingest import Ingest
    from stepmill.tags import Tags
    from stepmill.store import Store

    store = Store(tmp_path / "steps.db")
    call = Call(api="openai.chat" if kind == "failure" else "no.such.api", host="h", path="/v1/chat/completions",
                tags=Tags("t-fallback", "g-fallback", None))
    assert Ingest(store).handle(CallRecord(kind=kind, call=call, started=time.time(), error="boom"),
                                [b"{}", b""]) == "bare"
    [row] = store.query("SELECT trajectory_id, group_id, status FROM steps")
    assert (row["trajectory_id"], row["group_id"], row["status"]) == ("t-fallback", "g-fallback", "error")
    store.close()
