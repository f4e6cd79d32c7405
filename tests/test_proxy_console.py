"""What `stepmill proxy` prints is true, and is for a person to read: the addresses it really listens on
with how agents use each, its start-up lines and errors, and no line per call."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from types import SimpleNamespace

from stepmill.children import free_port
from stepmill.cli.capture import listening_lines
from stepmill.cli.proxy_args import listeners

from .conftest import STEPMILL, answers, stop_proxy, wait_until


def lines_for(*args: str, control: str | None = None, confdir: str = "~/.mitmproxy") -> list[str]:
    return listening_lines(listeners(list(args), "127.0.0.1", 8080), control, confdir)


def test_every_mode_says_where_it_listens_and_how_agents_use_it():
    assert lines_for("--mode", "regular@9000") == [
        "proxy on http://127.0.0.1:9000", 'agents: eval "$(stepmill env --port 9000)"']
    assert lines_for("--mode", "reverse:http://127.0.0.1:8000@9001") == [
        "reverse proxy to http://127.0.0.1:8000 on http://127.0.0.1:9001",
        "agents: OPENAI_BASE_URL=http://127.0.0.1:9001/v1 (tagged: http://127.0.0.1:9001/t/<trajectory>/g/<group>/v1)"]
    # no @port: mitmproxy's --listen-port, which the CLI sets to --port
    assert lines_for("--mode", "upstream:http://corp:3128")[0] == "proxy to the upstream proxy http://corp:3128 on " \
                                                                  "http://127.0.0.1:8080"
    assert lines_for("--mode", "regular@0.0.0.0:9002", confdir="/srv/mitm") == [
        "proxy on http://127.0.0.1:9002 (every address)",
        'agents: eval "$(stepmill env --port 9002 --confdir /srv/mitm)"']
    assert lines_for("--mode", "regular@10.1.2.3:9003")[1] == 'agents: eval "$(stepmill env --host 10.1.2.3 --port 9003)"'
    assert lines_for("--mode", "socks5@9004") == ["socks5 mode (socks5@9004) on 127.0.0.1:9004"]
    control = "reverse:http://stepmill.local@9005"
    assert lines_for("--mode", control, "--mode", "regular@9000", control=control)[-1] == \
        "control API on http://127.0.0.1:9005"


def start_reverse(tmp_path, upstream, *extra: str) -> SimpleNamespace:
    """`stepmill proxy` with one reverse mode to the test upstream and nothing else, answering."""
    port, log = free_port(), tmp_path / "proxy.log"
    process = subprocess.Popen(
        STEPMILL + ["proxy", "--db", str(tmp_path / "steps.db"), "--confdir", str(tmp_path / "mitm"),
                    "--mode", f"reverse:https://127.0.0.1:{upstream.port}@{port}",
                    "--set", f"ssl_verify_upstream_trusted_ca={upstream.ca}", *extra],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/_stepmill/v1/health") or process.poll() is not None,
                   timeout=60, what="proxy start")
        assert process.poll() is None, log.read_text()
    except BaseException:
        process.kill()
        raise
    return SimpleNamespace(process=process, log=log, port=port)


def stream_through(port: int, text: str) -> None:
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=15) as response:
        assert b"[DONE]" in response.read()


def test_a_reverse_proxy_prints_its_own_port_and_no_line_per_call(tmp_path, upstream):
    proxy = start_reverse(tmp_path, upstream, "--workers", "2")
    try:
        printed = proxy.log.read_text()
        assert f"reverse proxy to https://127.0.0.1:{upstream.port} on http://127.0.0.1:{proxy.port}\n" in printed
        assert f"agents: OPENAI_BASE_URL=http://127.0.0.1:{proxy.port}/v1 " in printed
        assert "stepmill env" not in printed and ":8080" not in printed  # nothing listens there
        assert re.findall(r"on http://127\.0\.0\.1:(\d+)", printed) == [str(proxy.port)]
        for i in range(3):  # through the printed address
            stream_through(proxy.port, f"console {i}")
    finally:
        stop_proxy(proxy)
    printed = proxy.log.read_text()
    assert "stepmill 0.1.0: steps in" in printed and "mitmproxy CA: " in printed  # start-up lines
    for per_call in ("Streaming response", "client connect", "client disconnect", "server connect", "POST "):
        assert per_call not in printed, printed


def test_per_call_lines_come_back_with_flow_detail(tmp_path, upstream):
    """`--set flow_detail=1` brings mitmproxy's lines for each call back, as the README says."""
    proxy = start_reverse(tmp_path, upstream, "--workers", "1", "--set", "flow_detail=1")
    try:
        stream_through(proxy.port, "shown")
    finally:
        stop_proxy(proxy)
    assert "Streaming response" in proxy.log.read_text()


def test_the_onboarding_page_still_answers(proxy):
    """mitm.it (mitmproxy's page for installing its CA) is loaded when first asked for, not at start."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy.url}))
    with opener.open("http://mitm.it/", timeout=15) as response:
        assert response.status == 200 and b"mitmproxy" in response.read()
    with opener.open("http://mitm.it/cert/pem", timeout=15) as response:
        assert response.read() == (proxy.confdir / "mitmproxy-ca-cert.pem").read_bytes()
