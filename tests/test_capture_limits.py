"""Limits of what stepmill keeps and where it answers: a body past stepmill_max_body passes through whole
while the step keeps a bounded, marked part; the control port answers under mitmproxy's defaults."""

from __future__ import annotations

import gzip
import json
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmill.addon.stream_tap import StreamTap
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.handoff import Handoff
from stepmill.children import free_port
from stepmill.store.encoding import loads

from .conftest import STEPMILL, http_json, start_proxy, stop_proxy, wait_until

CAP = 64 * 1024


def long_stream(model: str, events: int = 2000) -> bytes:
    """About 1 MB of chat chunks, far past CAP, ending as a stream should."""
    out = []
    for i in range(events):
        out.append(b"data: " + json.dumps({"id": "c1", "model": model, "choices": [
            {"index": 0, "delta": {"content": f"{i:05d} " + "x" * 480}, "finish_reason": None}]}).encode() + b"\n\n")
    return b"".join(out) + b"data: [DONE]\n\n"


class LongUpstream(BaseHTTPRequestHandler):
    """Plain HTTP: a long stream for stream requests, a short answer otherwise; records request sizes."""
    protocol_version = "HTTP/1.1"
    received: list[int] = []  # noqa: RUF012  (shared by the handler instances, one per request)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        LongUpstream.received.append(len(body))
        request = json.loads(body)
        if request.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            data = long_stream(request["model"])
            for start in range(0, len(data), 16384):
                self.wfile.write(data[start:start + 16384])
                self.wfile.flush()
            self.close_connection = True
            return
        answer = json.dumps({"id": "c2", "object": "chat.completion", "model": request["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def long_upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), LongUpstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _post(url: str, body: bytes, proxy: str) -> bytes:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    with opener.open(request, timeout=60) as response:
        return response.read()


def test_bodies_past_the_cap_pass_whole_and_are_kept_cut(tmp_path, upstream, long_upstream, marker):
    own = start_proxy(tmp_path, upstream, "--set", f"stepmill_max_body={CAP}", "--set", "stepmill_engine_hosts=none")
    try:
        model = f"long-{marker}"
        got = _post(f"{long_upstream}/v1/chat/completions",
                    json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "go"}]}).encode(),
                    own.url)
        assert got == long_stream(model), "the client receives every byte, unchanged"
        big = json.dumps({"model": model, "messages": [{"role": "user", "content": "y" * (3 * CAP)}]}).encode()
        assert json.loads(_post(f"{long_upstream}/v1/chat/completions", big, own.url))["choices"]
        assert LongUpstream.received[-1] == len(big), "the upstream receives the whole request"
        store = own.store()
        try:
            wait_until(lambda: store.query("SELECT count(*) AS n FROM steps")[0]["n"] >= 2, what="2 steps")
            rows = store.query("SELECT transport, status, error, metadata, raw_request, raw_response FROM steps")
        finally:
            store.close()
    finally:
        stop_proxy(own)
    stream = next(r for r in rows if r["transport"] == "sse")
    assert stream["status"] == "incomplete" and "response truncated for recording" in stream["error"]
    note = f"stepmill kept the first {CAP} of its {len(long_stream(model))} bytes"
    assert any(note in n for n in loads(stream["metadata"])["notes"])
    assert len(stream["raw_response"]) <= CAP and long_stream(model).startswith(stream["raw_response"])
    request = next(r for r in rows if r["transport"] == "http")
    assert request["status"] == "error" and "request truncated for recording" in request["error"]
    assert any(f"kept the first {CAP} of its {len(big)} bytes" in n for n in loads(request["metadata"])["notes"])
    assert request["raw_request"] == big[:CAP]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40), limit=st.integers(1, 20000),
       rewrite=st.booleans())
def test_the_tap_keeps_at_most_its_limit_and_passes_everything(sizes, limit, rewrite):
    body = long_stream("m", events=max(1, sum(sizes) // 500))
    chunks, start = [], 0
    for size in sizes + [len(body)]:
        if start < len(body):
            chunks.append(body[start:start + size])
            start += size
    tap = StreamTap(rewrite=(lambda payload: False) if rewrite else None, markers=("model",), limit=limit)
    sent = b"".join(part for chunk in chunks + [b""] for part in tap(chunk))
    assert sent == body
    assert bytes(tap.raw) == body[:limit] and tap.received == len(body)
    assert all(end <= limit for end, _ in tap.marks)


def test_a_decoded_body_is_cut_at_the_limit_too():
    """A small compressed body may decode to far more than the limit: what is kept stays bounded."""
    plain = json.dumps({"model": "m", "messages": [{"role": "user", "content": "z" * 500_000}]}).encode()
    record, [request, response] = Handoff.clean(
        CallRecord(kind="http", call=Call("openai.chat", "h", "/p"), max_body=CAP, request_encoding="gzip"),
        [gzip.compress(plain), b"{}"])
    assert request == plain[:CAP] and response == b"{}"
    assert record.request_encoding is None and "decoded body" in record.truncated[0]


def test_control_port_answers_under_default_options(tmp_path):
    """No --set connection_strategy=lazy: mitmproxy's default (eager) must not dial stepmill.local first."""
    port, control_port, log = free_port(), free_port(), tmp_path / "proxy.log"
    process = subprocess.Popen(STEPMILL + ["proxy", "--port", str(port), "--control-port", str(control_port),
                                           "--db", str(tmp_path / "steps.db"), "--confdir", str(tmp_path / "mitm")],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def health():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{control_port}/v1/health", timeout=5) as response:
                return response.status, response.read()
        except OSError:
            return None

    try:
        wait_until(lambda: process.poll() is not None or answers_regular(port), timeout=60, what="proxy start")
        assert process.poll() is None, log.read_text()
        # ok once every worker's capture threads run (a worker still starting is not ok yet)
        status, body = wait_until(lambda: (got := health()) and b'"ok": true' in got[1] and got, timeout=20,
                                  what="the control port's answer, ok")
        assert status == 200
        assert http_json("GET", "http://stepmill.local/v1/health", proxy=f"http://127.0.0.1:{port}")[0] == 200
    finally:
        process.terminate()
        process.wait(15)


def answers_regular(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
