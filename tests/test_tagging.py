"""Explicit trajectory and group tags: reverse-mode paths, headers, proxy credentials."""

import hypothesis
import openai
import pytest
from hypothesis import strategies as st


def test_reverse_mode_path_tags(proxy, marker):
    # An agent that only takes a base_url points it at the reverse-mode listener, tags in the path.
    client = openai.OpenAI(api_key="sk-x", base_url=f"http://127.0.0.1:{proxy.reverse_port}/t/traj-{marker}/g/grp-{marker}/v1",
                           max_retries=0)
    reply = client.chat.completions.create(model="qwen-test", messages=[{"role": "user", "content": f"hi {marker}"}])
    assert reply.choices[0].message.content == f"Echo: hi {marker}"
    [step] = proxy.trajectory_steps(f"traj-{marker}", 1)
    assert step["group_id"] == f"grp-{marker}"
    assert step["host"] == "127.0.0.1"
    # the tag prefix is not forwarded: the upstream saw /v1/chat/completions (else it would have 404'd)
    store = proxy.store()
    assert store.query("SELECT path FROM steps WHERE id = ?", [step["step_id"]])[0]["path"] == "/v1/chat/completions"


def test_header_tags_are_used_and_removed(proxy, openai_client, marker):
    openai_client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": f"hdr {marker}"}],
        extra_headers={"X-Stepmill-Trajectory": f"h-{marker}", "X-Stepmill-Group": f"hg-{marker}",
                       "X-Stepmill-Channel": "eval"})
    [step] = proxy.trajectory_steps(f"h-{marker}", 1)
    assert step["group_id"] == f"hg-{marker}" and step["channel"] == "eval"
    store = proxy.store()
    headers = store.query("SELECT b.body FROM steps s JOIN blobs b ON b.hash = s.headers_hash WHERE s.id = ?",
                          [step["step_id"]])[0]["body"]
    assert "x-stepmill" not in headers.lower()


def test_proxy_credentials_tag_a_whole_process(proxy, marker):
    import ssl

    import httpx2

    url = f"http://run-{marker}:grp-{marker}@127.0.0.1:{proxy.port}"
    http_client = httpx2.Client(proxy=url, verify=ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"]))
    client = openai.OpenAI(api_key="sk-x", base_url="https://api.openai.com/v1", http_client=http_client, max_retries=0)
    for turn in range(2):
        client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"p{turn} {marker}"}])
    steps = proxy.trajectory_steps(f"run-{marker}", 2)
    assert {s["group_id"] for s in steps} == {f"grp-{marker}"}


def test_env_command_tags_with_credentials(proxy, marker):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "stepmill.cli", "env", "--port", str(proxy.port), "--confdir",
                          str(proxy.confdir), "--trajectory", f"e-{marker}", "--group", "g1"],
                         capture_output=True, text=True, check=True).stdout
    assert f"HTTPS_PROXY=http://e-{marker}:g1@127.0.0.1:{proxy.port}" in out
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE"):
        assert f"export {name}=" in out
    assert "NODE_USE_ENV_PROXY=1" in out
    bundle = proxy.env["SSL_CERT_FILE"]
    text = open(bundle).read()
    assert text.count("BEGIN CERTIFICATE") > 1, "the bundle holds the system CAs and the mitmproxy CA"
    assert open(proxy.confdir / "mitmproxy-ca-cert.pem").read().strip() in text


def test_non_llm_traffic_passes_untouched(proxy, marker):
    import http.server
    import threading
    import urllib.request

    class Page(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"plain page: " + body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = proxy.store()
    before = store.query("SELECT count(*) AS n FROM steps")[0]["n"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy.url}))
    with opener.open(urllib.request.Request(f"http://127.0.0.1:{server.server_port}/v1/other",
                                            data=marker.encode(), method="POST"), timeout=10) as response:
        assert response.read() == b"plain page: " + marker.encode()
    server.shutdown()
    assert store.query("SELECT count(*) AS n FROM steps")[0]["n"] == before


def test_capture_limited_to_configured_hosts(tmp_path, upstream, marker):
    import ssl

    import anthropic
    import httpx2

    from .conftest import start_proxy, stop_proxy

    own = start_proxy(tmp_path, upstream, "--set", "stepmill_hosts=api.anthropic.com")
    try:
        http = httpx2.Client(proxy=own.url, verify=ssl.create_default_context(cafile=own.env["SSL_CERT_FILE"]))
        openai.OpenAI(api_key="x", base_url="https://api.openai.com/v1", http_client=http, max_retries=0) \
            .chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"skip {marker}"}])
        anthropic.Anthropic(api_key="x", base_url="https://api.anthropic.com", http_client=http, max_retries=0) \
            .messages.create(model="claude-test", max_tokens=10, messages=[{"role": "user", "content": f"keep {marker}"}])
        [step] = own.steps("1")
        assert step["api"] == "anthropic.messages"
        assert "mitmproxy CA: " + str(own.confdir / "mitmproxy-ca-cert.pem") in own.log.read_text()
    finally:
        stop_proxy(own)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.one_of(
    st.sampled_from(["api.openai.com", "API.OpenAI.com:443", "127.0.0.1:8000", "[::1]:8080", "[2001:db8::1]",
                     "xn--bcher-kva.example", "bücher.example:81", "", "host:notaport", ":80"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)))
def test_the_host_a_call_is_recorded_under_is_mitmproxys_pretty_host(authority):
    """The addon parses each Host header once (cached): the host it records and filters on
    (stepmill_hosts) is the one mitmproxy's ``pretty_host`` gives, whatever an agent sends."""
    from mitmproxy import http

    from stepmill.addon.http_capture import _pretty_host

    request = http.Request.make("POST", "http://upstream.example:8080/v1/chat/completions", b"{}")
    request.headers.pop("Host", None)
    if authority:
        request.headers["Host"] = authority
    try:
        expected = request.pretty_host
    except Exception as exc:  # mitmproxy refuses it: so does the cached parse, alike
        with pytest.raises(type(exc)):
            _pretty_host(request)
        return
    assert _pretty_host(request) == expected
    assert _pretty_host(request) == expected  # and again, from the cache
