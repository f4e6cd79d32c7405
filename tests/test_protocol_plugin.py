"""A protocol written outside stepmill: one module in another package, registered through the
``stepmill.protocols`` entry points, recorded end to end by a real ``stepmill proxy`` (whole and streamed);
and an entry point that is broken stops the registry with an error that names it."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from stepmill.errors import PluginError
from stepmill.protocols import registry
from stepmill.http_answers import send_json

from .conftest import STEPMILL, launch_proxy, stop_proxy

# A made-up JSON protocol: {"model", "prompt", "stream"} in; {"text", "usage"} out, or SSE events of
# {"delta"} ending in {"done": true, "usage"}.
TOY = textwrap.dedent('''
    import json

    from stepmill.protocols.base import Completion, ParsedRequest, ProtocolError, usage_of
    from stepmill.protocols.contract import Protocol

    API = "toy.chat"


    def parse_request(body, api=API):
        if not isinstance(body.get("prompt"), str):
            raise ProtocolError("toy request has no 'prompt'")
        return ParsedRequest(api=api, model=body.get("model"), stream=bool(body.get("stream")),
                             params={k: v for k, v in body.items() if k != "prompt"},
                             messages=[{"role": "user", "content": body["prompt"]}])


    def _usage(raw):
        return usage_of(raw, input_key="in", output_key="out")


    def parse_response(body, api=API):
        return Completion(message={"role": "assistant", "content": body.get("text") or ""},
                          wire=[{"text": body.get("text")}], finish_reason="stop", usage=_usage(body.get("usage")))


    class StreamAssembler:
        def __init__(self, api=API):
            self.text, self.usage, self.notes, self.output_started, self.done = [], None, [], False, False

        @property
        def terminal(self):
            return self.done

        def feed(self, event, data):
            self.feed_parsed(event, json.loads(data))

        def feed_parsed(self, event, chunk):
            if chunk.get("delta"):
                self.text.append(chunk["delta"])
                self.output_started = True
            if chunk.get("done"):
                self.done, self.usage = True, chunk.get("usage")

        def finish(self):
            text = "".join(self.text)
            return Completion(message={"role": "assistant", "content": text}, wire=[{"text": text}],
                              finish_reason="stop" if self.done else None, usage=_usage(self.usage),
                              status="ok" if self.done else "incomplete",
                              error=None if self.done else "stream ended before done")


    PROTOCOL = Protocol(api=API, path=r"/toy/chat$", parse_request=parse_request, parse_response=parse_response,
                        StreamAssembler=StreamAssembler)
''')


def plugin_site(folder: Path, name: str, module_source: str, entry_points: str) -> Path:
    """A folder for PYTHONPATH holding one module and the .dist-info that registers its entry points,
    as pip would install a package that declares them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(module_source)
    info = folder / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[stepmill.protocols]\n{entry_points}\n")
    return folder


class ToyUpstream(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text = f"you said: {body['prompt']}"
        usage = {"in": len(body["prompt"].split()), "out": len(text.split())}
        if not body.get("stream"):
            return send_json(self, 200, {"text": text, "usage": usage})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for chunk in [{"delta": word + " "} for word in text.split(" ")] + [{"done": True, "usage": usage}]:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def toy_upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ToyUpstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _env(site: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


def test_a_protocol_from_another_package_is_recorded_end_to_end(tmp_path, toy_upstream, marker):
    site = plugin_site(tmp_path / "site", "toy_protocol", TOY, "toy = toy_protocol:PROTOCOL")
    proxy = launch_proxy(tmp_path / "proxy", toy_upstream, "--set", "termlog_verbosity=warn", env=_env(site))
    try:
        for stream in (False, True):
            request = urllib.request.Request(
                f"http://127.0.0.1:{proxy.reverse_port}/toy/chat", method="POST",
                data=json.dumps({"model": "toy-1", "prompt": f"hello {marker} {stream}", "stream": stream}).encode(),
                headers={"Content-Type": "application/json", "X-Stepmill-Trajectory": f"toy-{marker}"})
            with urllib.request.urlopen(request, timeout=15) as answer:
                raw = answer.read().decode()
            text = "".join(json.loads(line[len("data: "):]).get("delta", "") for line in raw.splitlines()
                           if line.startswith("data: ")) if stream else json.loads(raw)["text"]
            assert text.strip() == f"you said: hello {marker} {stream}"  # the agent's answer, as the upstream sent it
        steps = {step["messages"][0]["content"]: step for step in proxy.trajectory_steps(f"toy-{marker}", 2)}
        for stream in (False, True):
            step = steps[f"hello {marker} {stream}"]
            assert (step["api"], step["engine_api"], step["status"]) == ("toy.chat", None, "ok"), step
            assert step["transport"] == ("sse" if stream else "http") and step["model"] == "toy-1"
            assert step["messages"] == [{"role": "user", "content": f"hello {marker} {stream}"}]
            assert step["completion"]["content"].strip() == f"you said: hello {marker} {stream}"
            assert (step["usage"]["input_tokens"], step["usage"]["output_tokens"]) == (3, 5)
    finally:
        stop_proxy(proxy)


def test_a_broken_entry_point_is_named():
    def broken(value: str, name: str = "toy") -> str:
        with pytest.raises(PluginError) as raised:
            registry.build([EntryPoint(name=name, value=value, group=registry.GROUP)])
        return str(raised.value)

    message = broken("no_such_module_anywhere:PROTOCOL")
    assert message.startswith("the stepmill.protocols entry point toy = no_such_module_anywhere:PROTOCOL does not "
                              "load: ModuleNotFoundError")
    assert "which stepmill itself provides already" in broken("stepmill.protocols.openai_chat:CHAT_PROTOCOL")
    assert "gives str 'openai.chat', not a stepmill.protocols.contract.Protocol" in broken(
        "stepmill.protocols.openai_chat:CHAT")
    assert "names a module without PROTOCOL or PROTOCOLS" in broken("stepmill.protocols.base")
    # two plugins, one api: the second is named, and the first as the one that has it
    with pytest.raises(PluginError, match="entry point b = .* gives api 'x.chat', which the stepmill.protocols "
                                          "entry point a = "):
        registry.build([EntryPoint(name=n, value="tests.test_protocol_plugin:X_CHAT", group=registry.GROUP)
                        for n in ("a", "b")])
    built = registry.build([EntryPoint(name="a", value="tests.test_protocol_plugin:X_CHAT", group=registry.GROUP)])
    assert built.protocols[-1] is X_CHAT and built.match("/x/chat?stream=1") is X_CHAT
    assert built.match("/v1/chat/completions").api == "openai.chat"  # the built-in routes come first


def _x_chat():
    from stepmill.protocols import openai_chat
    from stepmill.protocols.contract import Protocol

    return Protocol(api="x.chat", path=r"/x/chat$", parse_request=openai_chat.parse_request,
                    parse_response=openai_chat.parse_response, StreamAssembler=openai_chat.StreamAssembler)


X_CHAT = _x_chat()


def test_the_proxy_refuses_to_start_with_a_broken_plugin(tmp_path):
    site = plugin_site(tmp_path / "site", "toy_broken", "PROTOCOL = 'not a protocol'\n",
                       "toy = toy_broken:PROTOCOL")
    done = subprocess.run(STEPMILL + ["proxy", "--db", str(tmp_path / "s.db"), "--confdir", str(tmp_path / "c")],
                          env=_env(site), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Error: the stepmill.protocols entry point toy = toy_broken:PROTOCOL " \
        "(of toy_broken) gives str 'not a protocol', not a stepmill.protocols.contract.Protocol" in done.stderr, \
        done.stderr
