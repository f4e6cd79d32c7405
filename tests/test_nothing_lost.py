"""Calls that used to be lost or mislabelled: each is a step with an honest status, what parsed,
and its raw bytes. Only LLM API paths are ever touched; `auto` never adds fields to a host that is
not positively a vLLM/SGLang engine."""

import http.server
import json
import ssl
import threading

import httpx2
import openai
import pytest
from websockets.sync.client import connect as ws_connect

from .conftest import start_proxy, stop_proxy


def _client(proxy, **kwargs):
    return httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                         timeout=30, **kwargs)


def test_non_utf8_header_still_records(proxy, marker):
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": f"cafe {marker}"}]}
    with _client(proxy) as client:
        response = client.post("https://api.openai.com/v1/chat/completions", json=body,
                               headers={"X-Title": b"Caf\xe9", "User-Agent": b"agent/\xff\xfe"})
    assert response.status_code == 200
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%cafe {marker}%"])
    assert step["status"] == "ok" and step["completion"]["content"] == f"Echo: cafe {marker}"


def test_huge_integers_are_kept_as_text(proxy, marker):
    body = json.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": 12345678901234567890123}],
                       "seed": 2**70})
    with _client(proxy) as client:
        client.post("https://api.openai.com/v1/chat/completions", content=body.encode(),
                    headers={"Content-Type": "application/json", "X-Stepmill-Trajectory": f"int-{marker}"})
    [step] = proxy.trajectory_steps(f"int-{marker}", 1)
    assert step["messages"] == [{"role": "user", "content": "12345678901234567890123"}]
    assert step["params"]["seed"] == 2**70


@pytest.mark.parametrize("odd", [
    {"role": "assistant", "content": None, "tool_calls": {"id": "x"}},  # an object where a list belongs
    {"role": "assistant", "content": None, "tool_calls": ["not a call"]},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": "get_weather()"}]},
])
def test_unexpected_request_shapes_are_error_steps_with_raw_bytes(proxy, marker, odd):
    body = json.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": f"shape {marker}"}, odd]})
    with _client(proxy) as client:
        client.post("https://api.openai.com/v1/chat/completions", content=body.encode(),
                    headers={"Content-Type": "application/json", "X-Stepmill-Trajectory": f"shape-{marker}-{id(odd)}"})
    [step] = proxy.trajectory_steps(f"shape-{marker}-{id(odd)}", 1)
    row = proxy.store().query("SELECT status, error, raw_request FROM steps WHERE id = ?", [step["step_id"]])[0]
    assert row["status"] == "error" and row["error"]
    assert marker.encode() in row["raw_request"]


def test_lone_surrogate_in_a_websocket_turn_is_kept(proxy, marker):
    with ws_connect("wss://api.openai.com/v1/responses", proxy=proxy.url,
                    ssl=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                    additional_headers={"session_id": f"surrogate-{marker}"}) as ws:
        ws.send('{"type": "response.create", "model": "gpt-test", "input": "lone \\ud800 ' + marker + '"}')
        while json.loads(ws.recv(timeout=10))["type"] != "response.completed":
            pass
    [step] = proxy.trajectory_steps(f"surrogate-{marker}", 1)
    assert step["status"] == "ok" and marker in step["messages"][-1]["content"]


def test_odd_client_frames_do_not_end_a_websocket_turn(proxy, marker):
    with ws_connect("wss://api.openai.com/v1/responses", proxy=proxy.url,
                    ssl=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]),
                    additional_headers={"session_id": f"frames-{marker}"}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "gpt-test", "input": f"frames {marker}"}))
        ws.send("not json at all")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": ""}))
        ws.send(json.dumps(["a", "list"]))
        while json.loads(ws.recv(timeout=10))["type"] != "response.completed":
            pass
    [step] = proxy.trajectory_steps(f"frames-{marker}", 1)
    assert step["status"] == "ok" and step["completion"]["content"] == f"Echo: frames {marker}"


def test_bad_logprobs_keep_the_conversation_and_ids(proxy, marker):
    engine = openai.OpenAI(api_key="sk-x", base_url="https://engine.local/v1", max_retries=0)
    engine.chat.completions.create(model="qwen-bad-logprobs", messages=[{"role": "user", "content": f"lp {marker}"}])
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%lp {marker}%"])
    assert step["status"] == "ok" and step["messages"][-1]["content"] == f"lp {marker}"
    assert step["response_ids"] and step["logprobs"] is None
    assert any("logprobs has" in note for note in step["metadata"]["notes"])


def test_non_llm_paths_pass_byte_identical(proxy, marker):
    """A forum URL that looks like a tag path, and stepmill's own headers on a non-LLM call: untouched."""
    seen = {}

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen["path"], seen["headers"] = self.path, dict(self.headers)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx2.Client(proxy=proxy.url, timeout=10) as client:
            for path in ("/t/how-to-fix-x/12345", "/t/a/g/b/v1/other", "/t/x/g/y/_stepmill/v1/health"):
                client.get(f"http://127.0.0.1:{server.server_port}{path}",
                           headers={"X-Stepmill-Trajectory": "forum", "X-Stepmill-Group": "g"})
                assert seen["path"] == path
                assert seen["headers"].get("X-Stepmill-Trajectory") == "forum"
    finally:
        server.shutdown()


def test_auto_never_adds_fields_to_a_host_that_is_not_an_engine(proxy, marker):
    """gateway.local rejects unknown fields, as a company gateway would; engine.local is vLLM."""
    gateway = openai.OpenAI(api_key="sk-x", base_url="https://gateway.local/v1", max_retries=0)
    reply = gateway.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"gw {marker}"}])
    assert reply.choices[0].message.content == f"Echo: gw {marker}"
    sent = next(r for r in reversed(proxy.upstream.requests) if f"gw {marker}" in json.dumps(r))
    assert "return_token_ids" not in sent and "logprobs" not in sent
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%gw {marker}%"])
    assert step["status"] == "ok" and step["token_provenance"] == "none"


def test_cli_takes_the_users_set_for_its_own_options(tmp_path, upstream, marker):
    """`--set stepmill_db=…` and `--set confdir=…` are the user's choice, not silently lost; an explicit
    engine host list forces injection even for a host that rejects it."""
    other_db, other_confdir = tmp_path / "mine.db", tmp_path / "my-confdir"
    own = start_proxy(tmp_path / "p", upstream, "--set", f"stepmill_db={other_db}", "--set",
                      f"confdir={other_confdir}", "--set", "stepmill_engine_hosts=gateway.local")
    try:
        assert (other_confdir / "mitmproxy-ca-cert.pem").exists() and (other_confdir / "stepmill-token").exists()
        verify = ssl.create_default_context(cafile=str(other_confdir / "stepmill-ca-bundle.pem"))
        client = openai.OpenAI(api_key="sk-x", base_url="https://gateway.local/v1", max_retries=0,
                               http_client=httpx2.Client(proxy=own.url, verify=verify))
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"forced {marker}"}])
        own.db = other_db
        [step] = own.steps("1")
        assert step["status"] == "error" and "return_token_ids" in step["error"]
        assert not (tmp_path / "p" / "steps.db").exists()
    finally:
        own.confdir = other_confdir
        stop_proxy(own)


def test_event_streams_of_other_apis_pass_unbuffered(proxy, marker):
    """Not an LLM path, but an event stream: it passes as it comes (mitmproxy would buffer it whole)."""
    release = threading.Event()

    class Events(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for data in (b"data: first\n\n", b"data: second\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                release.wait(10)
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Events)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx2.Client(proxy=proxy.url, timeout=10) as client:
            with client.stream("GET", f"http://127.0.0.1:{server.server_port}/events/{marker}") as response:
                lines = response.iter_lines()
                assert next(lines) == "data: first"  # before the server sends the rest
                release.set()
                assert "data: second" in list(lines)
    finally:
        release.set()
        server.shutdown()
