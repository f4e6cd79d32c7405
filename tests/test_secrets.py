"""No secret is ever written: each way agents send credentials, then the whole database file, its
WAL and the proxy's log are scanned for the secret bytes."""

import gzip
import json
import ssl
import zlib

import anthropic
import httpx2
import openai
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as ws_connect

from stepmill.pipeline.redaction import redact_text
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.handoff import Handoff

from .conftest import start_proxy, stop_proxy, wait_until


def test_no_secret_reaches_the_database(tmp_path, upstream, marker):
    secret = lambda name: f"{name}SECRET{marker}"  # noqa: E731  (every secret contains SECRET{marker})
    proxy_password = secret("PROXYPASS")
    own = start_proxy(tmp_path, upstream, "--set", "stepmill_keep_raw=true",
                      "--set", f"proxyauth=agent:{proxy_password}")
    try:
        proxy_url = f"http://agent:{proxy_password}@127.0.0.1:{own.port}"
        verify = ssl.create_default_context(cafile=own.env["SSL_CERT_FILE"])
        http = httpx2.Client(proxy=proxy_url, verify=verify, timeout=30)
        headers = {"ocp-apim-subscription-key": secret("APIM"), "helicone-auth": f"Bearer {secret('HELICONE')}",
                   "x-portkey-api-key": secret("PORTKEY"), "cookie": f"session={secret('COOKIE')}",
                   "x-goog-api-key": secret("GOOG")}
        chat = openai.OpenAI(api_key=f"sk-{secret('OPENAIKEY')}", base_url="https://api.openai.com/v1",
                             http_client=http, max_retries=0, default_headers=headers)
        # header keys, a key in the URL query, and keys in the JSON body
        chat.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"one {marker}"}],
                                     extra_query={"key": secret("QUERYKEY"), "api_key": secret("QUERYAPIKEY")},
                                     extra_body={"api_key": secret("BODYKEY"),
                                                 "metadata": {"user": "u1", "auth_token": secret("NESTED")}})
        anthropic.Anthropic(api_key=secret("ANTHROPICKEY"), base_url="https://api.anthropic.com", http_client=http,
                            max_retries=0).messages.create(
            model="claude-test", max_tokens=10, messages=[{"role": "user", "content": f"two {marker}"}])
        # a failed call keeps its raw body: the key in it must not survive
        broken = json.dumps({"model": "gpt-test", "api_key": secret("RAWKEY"),
                             "messages": [{"role": "user", "content": f"three {marker} sk-proj-{secret('INLINE')}"}]})
        http.post("https://api.openai.com/v1/chat/completions", content=broken[:-5].encode(),
                  headers={"Authorization": f"Bearer {secret('BROKENAUTH')}", "Content-Type": "application/json"})
        # Responses over WebSocket with the browser-style key in the subprotocol
        with ws_connect("wss://api.openai.com/v1/responses", proxy=proxy_url, ssl=verify,
                        subprotocols=["realtime", f"openai-insecure-api-key.{secret('WSPROTO')}"],
                        additional_headers={"Authorization": f"Bearer {secret('WSAUTH')}"}) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "gpt-test", "input": f"four {marker}"}))
            while json.loads(ws.recv(timeout=10))["type"] != "response.completed":
                pass
        store = own.store()
        wait_until(lambda: store.query("SELECT count(*) AS n FROM steps")[0]["n"] >= 4, what="4 steps")
        assert store.query("SELECT count(*) AS n FROM steps WHERE raw_request IS NOT NULL")[0]["n"] >= 4
        kept = store.query("SELECT body FROM blobs WHERE body LIKE '%user-agent%'")
        assert kept, "identifying headers are still kept"
        store.db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        store.close()
        segments = list((tmp_path / "steps.db.journal").rglob("*.seg"))
        assert segments, "every call went through the journal"
        journal = b"".join(p.read_bytes() for p in segments)
        assert secret("").encode() not in journal, "a secret was written to the journal"
    finally:
        stop_proxy(own)
    # the database, its WAL, the journal the proxy appends every call to (read while it ran), the log
    files = [p for p in tmp_path.rglob("*") if p.is_file() and "mitm" not in p.parts]
    everything = journal + b"".join(p.read_bytes() for p in files)
    assert f"one {marker}".encode() in everything and f"four {marker}".encode() in everything  # the scan reads data
    for path in files:
        data = path.read_bytes()
        assert secret("").encode() not in data, f"a secret was written to {path.name}: " + \
            repr(data[max(0, data.find(secret('').encode()) - 80): data.find(secret('').encode()) + 80])


def _inflated(data: bytes) -> bytes:
    """Every gzip stream inside ``data``, decompressed as far as it goes: a secret must not hide in one."""
    out, start = [], data.find(b"\x1f\x8b\x08")
    while start != -1:
        try:
            out.append(zlib.decompressobj(31).decompress(data[start:start + (1 << 24)]))
        except zlib.error:
            pass
        start = data.find(b"\x1f\x8b\x08", start + 1)
    return b"".join(out)


def test_no_secret_hides_in_a_compressed_body(tmp_path, upstream, marker):
    """Redaction sees bodies decoded: gzip requests (plain, streamed, failed) and a gzip stream."""
    secret = lambda name: f"{name}SECRET{marker}"  # noqa: E731
    own = start_proxy(tmp_path, upstream, "--set", "stepmill_keep_raw=true")
    try:
        http = httpx2.Client(proxy=own.url, verify=ssl.create_default_context(cafile=own.env["SSL_CERT_FILE"]),
                             timeout=30)
        gz = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        for name, model, stream in (("PLAIN", "gpt-test", False), ("STREAM", "gpt-test", True),
                                    ("GZSTREAM", "gzip-test", True)):
            body = {"model": model, "stream": stream, "api_key": secret(name),
                    "messages": [{"role": "user", "content": f"{name.lower()} {marker}"}]}
            response = http.post("https://api.openai.com/v1/chat/completions", headers=gz,
                                 content=gzip.compress(json.dumps(body).encode()))
            assert response.status_code == 200, response.text
        broken = json.dumps({"model": "gpt-test", "api_key": secret("BROKEN"),
                             "messages": [{"role": "user", "content": f"broken {marker}"}]})[:-4]
        http.post("https://api.openai.com/v1/chat/completions", headers=gz, content=gzip.compress(broken.encode()))
        store = own.store()
        wait_until(lambda: store.query("SELECT count(*) AS n FROM steps")[0]["n"] >= 4, what="4 steps")
        rows = store.query("SELECT status, raw_request FROM steps")
        assert sum(row["status"] == "ok" for row in rows) == 3, "the gzip requests parse as before"
        assert all(b'"api_key": "[redacted]"' in row["raw_request"] for row in rows), "kept decoded, redacted"
        store.db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        store.close()
        journal = b"".join(p.read_bytes() for p in (tmp_path / "steps.db.journal").rglob("*.seg"))
        assert f"broken {marker}".encode() in journal, "the journal holds the bodies decoded"
    finally:
        stop_proxy(own)
    files = [p for p in tmp_path.rglob("*") if p.is_file() and "mitm" not in p.parts]
    for data in [journal] + [p.read_bytes() for p in files]:
        assert secret("").encode() not in data + _inflated(data)


def test_kept_header_urls_lose_their_user_info(proxy, openai_client, marker):
    openai_client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": f"referer {marker}"}],
        extra_headers={"Referer": f"https://agent:PASS{marker}@app.example.com/page",
                       "HTTP-Referer": f"https://TOKEN{marker}@openrouter.example/",
                       "X-Title": f"see http://u:TITLE{marker}@h.example"})
    [step] = proxy.steps("s.messages_suffix LIKE ?", [f"%referer {marker}%"])
    store = proxy.store()
    try:
        [row] = store.query("SELECT b.body FROM steps s JOIN blobs b ON b.hash = s.headers_hash WHERE s.id = ?",
                            [step["step_id"]])
        assert not store.query("SELECT hash FROM blobs WHERE body LIKE ?", [f"%{marker}%"])
    finally:
        store.close()
    headers = json.loads(row["body"])
    assert headers["referer"] == "https://[redacted]@app.example.com/page"
    assert headers["http-referer"] == "https://[redacted]@openrouter.example/"
    assert headers["x-title"] == "see http://[redacted]@h.example"


@given(user=st.text(st.characters(blacklist_characters="/\\@\"'<>?# \t\r\n\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0",
                                  blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=40),
       scheme=st.sampled_from(["http", "https", "wss", "git+ssh"]), escaped=st.booleans(),
       before=st.text(max_size=20), host=st.from_regex(r"[a-z0-9.-]{1,20}(:[0-9]{1,5})?(/[a-z/]{0,10})?", fullmatch=True))
def test_url_user_info_is_redacted_anywhere(user, scheme, escaped, before, host):
    slashes = "\\/\\/" if escaped else "//"
    text = f"{before} {scheme}:{slashes}{user}@{host} after"
    redacted = redact_text(text)
    assert f"{scheme}:{slashes}[redacted]@{host} after" in redacted
    assert redact_text(redacted) == redacted


def _encoders():
    import brotli
    try:
        from compression import zstd
    except ImportError:
        from backports import zstd
    return {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress, "zstd": zstd.compress,
            "identity": lambda data: data, "raw-deflate": lambda data: zlib.compress(data, wbits=-15)}


@settings(max_examples=60, deadline=None)
@given(encoding=st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "raw-deflate"]),
       kind=st.sampled_from(["http", "sse", "failure"]), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_the_handoff_redacts_bodies_decoded(encoding, kind, cuts):
    """What the journal gets: every body decoded (whatever its content-encoding), then redacted."""
    key = "SECRETKEY-hypothesis-1234"
    request = json.dumps({"model": "m", "api_key": key, "messages": [{"role": "user", "content": "hi"}]}).encode()
    response = b"".join(b'data: {"n": %d, "token": "%s"}\n\n' % (i, key.encode()) for i in range(20))
    sent_as = "deflate" if encoding == "raw-deflate" else encoding
    compress = _encoders()[encoding]
    encoded = compress(response)
    marks = [(end, float(i)) for i, end in enumerate(sorted({min(c, len(encoded)) for c in cuts} | {len(encoded)}))]
    record = CallRecord(kind=kind, call=Call("openai.chat", "h", "/p", headers={"referer": "https://me:pw@x.example/"}),
                        request_encoding=sent_as, response_encoding=sent_as, marks=marks, max_body=1 << 20)
    cleaned, blobs = Handoff.clean(record, [compress(request), encoded])
    assert record.request_encoding == sent_as, "the call's own record is left as it came (retries)"
    assert all(key.encode() not in blob for blob in blobs)
    assert blobs[0] == request.replace(key.encode(), b"[redacted]")
    assert blobs[1] == response.replace(key.encode(), b"[redacted]")
    assert cleaned.request_encoding is None and cleaned.response_encoding is None
    assert cleaned.call.headers["referer"] == "https://[redacted]@x.example/"
    if kind == "sse":
        assert cleaned.marks[-1][0] == len(response) and [at for _, at in cleaned.marks] == \
            [at for _, at in marks]


def test_an_undecodable_body_is_not_kept():
    """Bytes that cannot be decoded cannot be redacted: the step says why, and they are not written."""
    cleaned, blobs = Handoff.clean(CallRecord(kind="http", call=Call("openai.chat", "h", "/p"), request_encoding="gzip",
                                              response_encoding="x-unknown"), [b"not gzip at all", b"secret stuff"])
    assert blobs == [b"", b""]
    assert "could not be decoded" in cleaned.request_problem and "x-unknown" in cleaned.response_problem
