"""No secret is ever written: each way agents send credentials, then the whole database file, its
WAL and the proxy's log are scanned for the secret bytes."""

import json
import ssl

import anthropic
import httpx2
import openai
from websockets.sync.client import connect as ws_connect

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
