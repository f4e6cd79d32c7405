"""A hostile-input campaign through a real `stepmill proxy`, 16 honest streams beside it.

Every protocol of the registry gets bodies nested 10^2-10^5 deep, numbers of 10^5 digits, NaN and
Infinity, duplicate keys, lone surrogates, invalid UTF-8 and bytes that are no JSON at all; openai.chat
also gets a 100 MB body, gzip and brotli bombs, a wrong content-length, an HTTP/2 reset mid-stream, and
answers no honest engine gives (10^6 tiny events, one 50 MB event, bombs, a short body). For each: what
the client got (the engine's answer, byte for byte where the body was forwarded untouched), what was
stored (one row, with the reason), and that every honest call made meanwhile is stored exactly once.
One proxy, one SQLite file, counted per call at the end (docs/capture/bad-input.md has the table).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmill.addon.engine_ids import read_json
from stepmill.protocols import ProtocolError, registry
from stepmill.protocols.streams import decode_kept
from stepmill.store.encoding import loads

from .conftest import http_json, start_proxy, stop_proxy, wait_until
from .upstream import BOMB, FLOOD_EVENTS, HUGE_EVENT, bomb


# One call per protocol of the registry, as an agent makes it, with ``@`` where the hostile value goes;
# the key before ``@`` is what a duplicate key repeats. All go to engine hosts: the body is read on the loop.
PROTOCOLS = {
    "openai.chat": ("engine.local", "/v1/chat/completions",
                    b'{"model": "hostile", "messages": [{"role": "user", "content": @}]}', b"content"),
    "openai.completions": ("engine.local", "/v1/completions", b'{"model": "hostile", "prompt": @}', b"prompt"),
    "openai.responses": ("engine.local", "/v1/responses", b'{"model": "hostile", "input": @}', b"input"),
    "anthropic.messages": ("engine.local", "/v1/messages",
                           b'{"model": "hostile", "max_tokens": 16, "messages": [{"role": "user", "content": @}]}',
                           b"content"),
    "gemini.generate": ("engine.local", "/v1beta/models/hostile:generateContent",
                        b'{"contents": [{"role": "user", "parts": [{"text": @}]}]}', b"text"),
    "sglang.generate": ("sglang.local", "/generate", b'{"text": @}', b"text"),
}
VALUES = {  # the hostile value, as JSON text (or not)
    **{f"deep-{n}": b"[" * n + b'"x"' + b"]" * n for n in (100, 1000, 10_000, 100_000)},
    "digits": b"1" * 100_000,
    "nan": b"[NaN, Infinity, -Infinity]",
    "duplicate-keys": b'"shadowed", @KEY: "kept"',
    "lone-surrogates": b'"\\ud800 and \\udfff alone"',
    "invalid-utf8": b'"\xff\xfe\xc0\x80"',
    "not-json": b"{'this': is not JSON",
}
HONEST_STREAMS = 16
TAGGED = re.compile(r"tag-[a-z0-9-]+")
NOT_READ = "forwarded untouched"  # the note of a body the event loop could not read
REFUSED = "stepmill refused this call"  # the proxy's own 400 to a Messages or Gemini body it cannot translate


@dataclass
class Case:
    name: str  # also the call's trajectory id and its X-Test-Case
    api: str
    body: bytes | Callable[[], bytes] = b""  # the big ones are made when sent, not when collected
    headers: dict = field(default_factory=dict)
    send: str = "post"  # how it is sent: post, stream, short-length, long-length, h2-reset
    rows: int = 1  # rows it must leave
    path: str | None = None  # another path than its protocol's


def body_case(value: str, api: str) -> Case:
    host, path, template, key = PROTOCOLS[api]
    hostile = VALUES[value].replace(b"@KEY", b'"' + key + b'"')
    return Case(f"h-{value}-{api}", api, template.replace(b"@", hostile))


def chat(content: bytes) -> bytes:
    return PROTOCOLS["openai.chat"][2].replace(b"@", content)


def few_cases() -> list[Case]:
    """The expensive ones, on openai.chat only."""
    zeros = b'"' + b"0" * 1000 + b'"'
    return [
        Case("h-100mb", "openai.chat", lambda: chat(b'"' + b"a" * (100 * 1024 * 1024) + b'"')),
        Case("h-bomb-gzip-request", "openai.chat", lambda: bomb("gzip", chat(b'"@"')), {"Content-Encoding": "gzip"}),
        Case("h-bomb-br-request", "openai.chat", lambda: bomb("br", chat(b'"@"')), {"Content-Encoding": "br"}),
        *(Case(f"h-answer-{kind}", "openai.chat", chat(zeros), {"X-Hostile-Answer": kind},
               send="stream" if kind in ("flood", "huge-event") else "post")
          for kind in ("flood", "huge-event", "bomb-gzip", "bomb-br", "wrong-length")),
        Case("h-short-length", "openai.chat", chat(b'"cut here"'), send="short-length"),
        Case("h-long-length", "openai.chat", chat(b'"never ends"'), send="long-length", rows=0),
        Case("h-h2-reset", "openai.chat", b'{"model": "gated-stream-h2-reset", "stream": true, '
                                          b'"messages": [{"role": "user", "content": "reset me"}]}', send="h2-reset"),
    ]


def tag_cases() -> list[Case]:
    """Tags that do not decode (they name no trajectory, and the call is still recorded): found by content."""
    credentials = "Basic " + base64.b64encode(b"\xff\xfe:\x80").decode()
    return [Case(f"tag-{name}", "openai.chat", chat(f'"tag-{name}"'.encode()), headers, path=path)
            for name, headers, path in (
                ("invalid-utf8-header", {"X-Stepmill-Trajectory": b"\xff\xfe\x80", "X-Session-Id": b"\xff",
                                         "User-Agent": b"agent\xff"}, None),
                ("invalid-utf8-host", {"Host": b"engine.local\xff"}, None),
                ("bad-tokens", {"X-Stepmill-Trajectory": "~%%%", "X-Stepmill-Group": "%FF%FE"}, None),
                ("bad-credentials", {"X-Stepmill-Trajectory": None, "Proxy-Authorization": credentials}, None),
                ("bad-path", {"X-Stepmill-Trajectory": None}, "/t/~_w/g/%FF/v1/chat/completions"))]


CASES = [body_case(value, api) for value in VALUES for api in PROTOCOLS] + few_cases() + tag_cases()


@dataclass
class Outcome:
    status: int | None = None  # the HTTP status the client got, None when it got none
    digest: str | None = None  # sha256 of the body it got
    body: bytes = b""  # its first bytes
    problem: str | None = None  # what the client saw go wrong
    seconds: float = 0.0
    sent: str = ""  # sha256 of the body sent


def body_of(case: Case) -> bytes:
    return case.body() if callable(case.body) else case.body


# -- clients --------------------------------------------------------------------------------------------------
def proxy_client(proxy, http2: bool = False) -> httpx2.Client:
    verify = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    return httpx2.Client(proxy=proxy.url, verify=verify, http2=http2, timeout=180, trust_env=False)


def headers_of(case: Case) -> dict:
    headers = {"Content-Type": "application/json", "X-Stepmill-Trajectory": case.name, "X-Test-Case": case.name,
               "Authorization": "Bearer sk-hostile", **case.headers}
    return {name: value for name, value in headers.items() if value is not None}


def send(proxy, case: Case) -> Outcome:
    started, outcome, body = time.time(), Outcome(), body_of(case)
    host, path, _, _ = PROTOCOLS[case.api]
    path = case.path or path
    try:
        if case.send in ("short-length", "long-length"):
            outcome = raw_exchange(proxy, host, path, case)
        elif case.send == "h2-reset":
            outcome = h2_reset(proxy, case)
        else:
            with proxy_client(proxy) as client, client.stream("POST", f"https://{host}{path}", content=body,
                                                              headers=headers_of(case)) as response:
                got = b"".join(response.iter_raw())  # the bytes as they came, not decoded
                outcome = Outcome(response.status_code, hashlib.sha256(got).hexdigest(), got[:4096])
                if case.send == "stream":
                    outcome.problem = stream_problem(case, got)
    except Exception as exc:
        outcome.problem = f"{type(exc).__name__}: {exc}"
    outcome.seconds, outcome.sent = time.time() - started, hashlib.sha256(body).hexdigest()
    return outcome


def stream_problem(case: Case, got: bytes) -> str | None:
    """What is wrong with a hostile stream as the client got it: every event, no engine field it did not ask for."""
    events = [e for e in got.split(b"\n\n") if e.startswith(b"data: {")]
    if case.name.endswith("flood"):
        return None if len(events) == FLOOD_EVENTS + 1 else f"{len(events)} events of {FLOOD_EVENTS + 1}"
    chunks = [json.loads(e[6:]) for e in events]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    if len(content) != HUGE_EVENT:
        return f"{len(content)} bytes of content, not {HUGE_EVENT}"
    if any(c.get("prompt_token_ids") or any(ch.get("token_ids") for ch in c["choices"]) for c in chunks):
        return "token ids the client did not ask for reached it"
    return None


def tunnel(proxy, host: str) -> ssl.SSLSocket:
    """A TLS connection to ``host`` through the proxy's CONNECT, as a raw socket."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    context = ssl.create_default_context(cafile=proxy.env["SSL_CERT_FILE"])
    return context.wrap_socket(sock, server_hostname=host)


def raw_exchange(proxy, host: str, path: str, case: Case) -> Outcome:
    """A request whose Content-Length lies: 8 bytes short (the rest arrives as garbage), or 1000 long (then the
    client stops sending and waits)."""
    declared = len(case.body) - 8 if case.send == "short-length" else len(case.body) + 1000
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-Stepmill-Trajectory: {case.name}\r\nX-Test-Case: {case.name}\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()
    with tunnel(proxy, host) as sock:
        sock.sendall(head + case.body)
        sock.settimeout(2 if case.send == "long-length" else 30)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
                if case.send == "short-length" and answered(got):
                    break  # the engine's answer; the garbage after the body is the proxy's to refuse
        except (TimeoutError, ssl.SSLError, OSError) as exc:
            if not got:
                return Outcome()  # no answer: the proxy still waits for the rest of the body
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return Outcome(status, hashlib.sha256(got).hexdigest(), got[:4096])


def answered(got: bytes) -> bool:
    """A whole HTTP/1.1 response with a Content-Length is in ``got``."""
    head, found, rest = got.partition(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(found and length and len(rest) >= length[0])


def h2_reset(proxy, case: Case) -> Outcome:
    """HTTP/2: the first event read, then the stream reset (CANCEL) while the engine still holds the rest."""
    with proxy_client(proxy, http2=True) as client, client.stream(
            "POST", "https://engine.local/v1/chat/completions", content=case.body, headers=headers_of(case)) as response:
        status, version = response.status_code, response.http_version
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # leaving the block resets the stream
    proxy.upstream.release("gated-stream-h2-reset")
    return Outcome(status, problem=None if version == "HTTP/2" else f"spoke {version}")


def direct(proxy, case: Case) -> int:
    """The status the engine itself gives this body, asked straight (no proxy)."""
    host, path, _, _ = PROTOCOLS[case.api]
    verify = ssl.create_default_context(cafile=str(proxy.upstream.ca))
    with httpx2.Client(verify=verify, timeout=60, trust_env=False) as client:
        headers = {**headers_of(case), "Host": host, "X-Test-Case": "direct-" + case.name}
        return client.post(f"https://127.0.0.1:{proxy.upstream.port}{path}", content=case.body, headers=headers).status_code


# -- honest streams -----------------------------------------------------------------------------------------------
class HonestStreams:
    """``HONEST_STREAMS`` agents calling all along, streamed and not, each call its own trajectory."""

    def __init__(self, proxy):
        self.proxy, self.stop = proxy, threading.Event()
        self.calls: dict[str, tuple[int | None, str, float]] = {}  # trajectory -> (status, content, seconds)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(HONEST_STREAMS)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _run(self, index: int):
        with proxy_client(self.proxy) as client:
            for k in range(10_000):
                if self.stop.is_set():
                    return
                self._call(client, index, k)

    def _call(self, client, index: int, k: int):
        trajectory, stream = f"honest-{index}-{k}", k % 2 == 0
        host = "engine.local" if index % 2 == 0 else "api.openai.com"  # the loop rewriting, and passing through
        body = {"model": "honest", "stream": stream, "messages": [{"role": "user", "content": f"hi {trajectory}"}]}
        started, status, content = time.time(), None, ""
        try:
            response = client.post(f"https://{host}/v1/chat/completions", json=body,
                                   headers={"X-Stepmill-Trajectory": trajectory, "Authorization": "Bearer sk-x"})
            status = response.status_code
            if stream:
                content = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                                  for line in response.text.split("\n\n") if line.startswith("data: {"))
            else:
                content = response.json()["choices"][0]["message"]["content"]
        except Exception as exc:
            content = f"{type(exc).__name__}: {exc}"
        self.calls[trajectory] = (status, content, time.time() - started)


# -- the campaign -------------------------------------------------------------------------------------------------
@dataclass
class Campaign:
    proxy: object
    outcomes: dict[str, Outcome]
    directs: dict[str, int]
    honest: dict[str, tuple]
    rows: dict[str, list[dict]]  # trajectory -> its rows (status, error, notes)


def stored_rows(proxy, trajectory: str | None = None) -> dict[str, list[dict]]:
    """The rows by call (its trajectory, or the content of a call whose tags do not decode)."""
    store = proxy.store()
    try:
        found: dict[str, list[dict]] = {}
        where, params = ("WHERE trajectory_id = ?", [trajectory]) if trajectory else ("", [])
        for row in store.query(f"SELECT trajectory_id, messages_suffix, status, error, metadata FROM steps {where}",
                               params):
            notes = loads(row["metadata"]).get("notes", []) if row["metadata"] else []
            tagged = TAGGED.search(row["messages_suffix"] or "")  # tags that do not decode: the call's content
            found.setdefault(tagged.group(0) if tagged else row["trajectory_id"], []).append(
                {"status": row["status"], "error": row["error"] or "", "notes": notes,
                 "trajectory": row["trajectory_id"]})
        return found
    finally:
        store.close()


def settled_rows(proxy, expected: set[str]) -> dict[str, list[dict]]:
    """The rows once every expected call has one (or 3 minutes passed: each call's test then says which has
    none), and a few commit windows later (a call stored twice shows)."""
    try:  # the writer runs at idle priority: on a busy machine it waits for a free core (CI has them)
        wait_until(lambda: expected <= set(stored_rows(proxy)), timeout=180, interval=1, what="a row for each call")
    except AssertionError:
        health = http_json("GET", f"http://127.0.0.1:{proxy.control_port}/v1/health")
        print(f"calls with no row: {sorted(expected - set(stored_rows(proxy)))}; the proxy's health: {health}")
    time.sleep(3)
    return stored_rows(proxy)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, upstream):
    proxy = start_proxy(tmp_path_factory.mktemp("hostile"), upstream)
    try:
        directs = {c.name: direct(proxy, c) for c in CASES if c.name.startswith(tuple(f"h-{v}-" for v in VALUES))}
        with HonestStreams(proxy) as honest, concurrent.futures.ThreadPoolExecutor(3) as pool:
            time.sleep(1)  # the honest streams are under way first
            outcomes = dict(zip([c.name for c in CASES], pool.map(lambda c: send(proxy, c), CASES)))
        expected = {c.name for c in CASES if c.rows} | set(honest.calls)
        yield Campaign(proxy, outcomes, directs, honest.calls, settled_rows(proxy, expected))
    finally:
        stop_proxy(proxy)


def campaign_test(test):
    """Slow, and given the time of the campaign itself (about 1.5 minutes on 2 free cores) when it runs first."""
    return pytest.mark.slow(pytest.mark.timeout(480)(test))


def test_every_protocol_of_the_registry_is_attacked():
    assert set(PROTOCOLS) == {p.api for p in registry.protocols()}


@dataclass
class Expect:
    client: int | None  # the status the client gets (None: no answer at all; ANY: an answer)
    status: str | None = None  # the row's status
    reason: tuple[str, ...] = ()  # each in the row's error
    note: str | None = None  # in one of the row's notes
    untouched: bool = False  # the engine got the client's bytes as they were


ANY = -1
UNREADABLE = {  # bodies the event loop cannot read, and what the stored error says
    "deep-10000": "nested too deeply", "deep-100000": "nested too deeply", "digits": "4300 digits",
    "invalid-utf8": "codec can't decode", "not-json": "not valid JSON"}
FEW = {
    "h-100mb": Expect(413, "error", ("request truncated for recording",), "more than stepmill_max_body"),
    "h-bomb-gzip-request": Expect(413, "error", ("request truncated for recording",), "decodes (gzip) to more"),
    "h-bomb-br-request": Expect(413, "error", ("request truncated for recording",), "decodes (br) to more"),
    "h-answer-flood": Expect(200, "ok"),
    "h-answer-huge-event": Expect(200, "ok"),
    "h-answer-bomb-gzip": Expect(200, "error", ("response truncated for recording",), "decodes (gzip) to more"),
    "h-answer-bomb-br": Expect(200, "error", ("response truncated for recording",), "decodes (br) to more"),
    "h-answer-wrong-length": Expect(502, "error"),
    "h-short-length": Expect(400, "error", ("not valid JSON", "upstream answered 400")),
    "h-long-length": Expect(None),
    "h-h2-reset": Expect(200, "incomplete", ("stream cut",)),
}


def expect(campaign, case: Case) -> Expect:
    if case.name in FEW:
        return FEW[case.name]
    if case.name.startswith("tag-"):  # the path's tags do not decode: it goes on as it is, and is not found
        return Expect(404, "error", ("upstream answered 404",)) if case.name == "tag-bad-path" else \
            Expect(502, "error") if case.name == "tag-invalid-utf8-host" else Expect(200, "ok")
    value = case.name.removeprefix("h-").removesuffix("-" + case.api)
    if value in UNREADABLE and registry.by_api(case.api).via_chat is not None:  # served through the engine's chat:
        return Expect(400, "error", (UNREADABLE[value], REFUSED))  # the proxy's own 400, nothing forwarded
    if value in UNREADABLE:
        return Expect(campaign.directs[case.name], "error", (UNREADABLE[value],), NOT_READ, untouched=True)
    return Expect(campaign.directs[case.name] if received(campaign, case) == "untouched" else ANY)


def received(campaign, case) -> str:
    """What reached the engine: the client's bytes ``untouched``, ``changed`` (ids asked for), or ``nothing``."""
    got = campaign.proxy.upstream.received.get(case.name)
    return "nothing" if got is None else "untouched" if got == campaign.outcomes[case.name].sent else "changed"


@campaign_test
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hostile_input(campaign, case):
    outcome, rows, want = campaign.outcomes[case.name], campaign.rows.get(case.name, []), expect(campaign, case)
    assert outcome.problem is None, outcome.problem
    assert len(rows) == case.rows, f"{len(rows)} rows for one call: {rows}"
    if want.client == ANY:
        assert outcome.status is not None, "the client got no answer"
    else:
        assert outcome.status == want.client, \
            f"the client got {outcome.status} ({outcome.body[:300]!r}), the engine answers {want.client}"
    if want.untouched:
        assert received(campaign, case) == "untouched", "the engine did not get the client's bytes as they were"
    if received(campaign, case) == "untouched" and case.name.startswith("h-"):  # said so in the step, never silently
        assert any(NOT_READ in n or "as it came" in n for n in rows[0]["notes"]), rows[0]["notes"]
    if not rows:
        return
    [row] = rows
    if want.status is not None:
        assert row["status"] == want.status, row
    for reason in want.reason:
        assert reason in row["error"], row["error"]
    if want.note is not None:
        assert any(want.note in n for n in row["notes"]), row["notes"]
    if row["status"] != "ok":
        assert row["error"], "a step that is not ok says why"


@campaign_test
def test_a_bomb_answer_reaches_the_client_as_the_engine_sent_it(campaign):
    for kind in ("gzip", "br"):
        sent = hashlib.sha256(bomb(kind)).hexdigest()
        assert campaign.outcomes[f"h-answer-bomb-{kind}"].digest == sent, f"the {kind} bomb was changed on its way"


@campaign_test
def test_an_upstream_that_hangs_up_mid_body_is_stored_with_that_reason(campaign):
    [row] = campaign.rows["h-answer-wrong-length"]
    hang_up, _, rest = row["error"].partition("; ")
    assert "peer closed connection without sending complete message body" in hang_up, row["error"]
    assert "not valid JSON" in rest, row["error"]


@campaign_test
def test_every_honest_call_is_stored_exactly_once(campaign):
    counts = {name: len(campaign.rows.get(name, [])) for name in campaign.honest}
    wrong = {name: n for name, n in counts.items() if n != 1}
    print(f"{len(counts)} honest calls; the slowest took {max(s for _, _, s in campaign.honest.values()):.1f} s")
    assert not wrong, f"honest calls not stored exactly once: {wrong}"
    answers = {name: (status, content) for name, (status, content, _) in campaign.honest.items()
               if (status, content) != (200, f"Echo: hi {name}")}
    assert not answers, f"honest calls that did not get their answer: {answers}"
    assert all(rows[0]["status"] == "ok" for name in campaign.honest for rows in [campaign.rows[name]])
    assert campaign.proxy.process.poll() is None, "the proxy did not outlive the campaign"


# -- what the campaign rests on, property by property (no proxy: fast) ------------------------------------------
class Raw(bytes):
    """JSON text written as it is (a number of 10^5 digits: Python would refuse to make it an int)."""


class Obj(list):
    """A JSON object as (key, value) pairs: a key may come twice."""


def json_text(value) -> bytes:
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, Obj):
        return b"{" + b", ".join(json.dumps(k).encode() + b": " + json_text(v) for k, v in value) + b"}"
    if isinstance(value, list):
        return b"[" + b", ".join(json_text(v) for v in value) + b"]"
    return json.dumps(value).encode()  # NaN, Infinity, lone surrogates (escaped) included


KEYS = st.sampled_from(["model", "messages", "role", "content", "text", "input", "prompt", "contents", "parts",
                        "type", "tools", "input_ids", "stream", "system", "n"]) | st.text(max_size=4)
LEAVES = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
          | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
          | st.integers(4301, 100_000).map(lambda n: Raw(b"9" * n)))
HOSTILE_JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                            | st.lists(st.tuples(KEYS, inner), max_size=5).map(Obj), max_leaves=20)
DEEP = st.tuples(st.integers(0, 3000), HOSTILE_JSON).map(lambda d: Raw(b"[" * d[0] + json_text(d[1]) + b"]" * d[0]))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(api=st.sampled_from(sorted(PROTOCOLS)), body=st.lists(st.tuples(KEYS, HOSTILE_JSON | DEEP), max_size=5))
def test_a_parser_refuses_a_hostile_body_with_a_reason(api, body):
    """Whatever JSON object arrives, a protocol's parser takes it or raises ProtocolError saying why."""
    protocol = registry.by_api(api)
    try:
        value = json.loads(json_text(Obj(body)))
    except (ValueError, RecursionError):
        return  # the writer's reason: not JSON Python reads, or nested too deeply
    try:
        protocol.parse_request(value, api)
    except ProtocolError as exc:
        assert str(exc)


ENCODINGS = st.sampled_from([None, "identity", "gzip", "br", "deflate", "zstd", "x-unknown"])


def encoded(encoding: str | None, data: bytes) -> bytes:
    import zlib

    import brotli
    from backports import zstd

    return {"gzip": lambda d: zlib.compress(d, wbits=31), "br": brotli.compress, "deflate": zlib.compress,
            "zstd": zstd.compress}.get(encoding, lambda d: d)(data)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=HOSTILE_JSON | DEEP, encoding=ENCODINGS, garbage=st.binary(max_size=8), where=st.integers(0, 10**6),
       limit=st.sampled_from([None, 64, 1 << 20]))
def test_the_loop_reads_a_body_or_says_why_not(value, encoding, garbage, where, limit):
    """The event loop's own read of a body (the engine-ids rewrite): a value, or a reason; never an exception."""
    text = json_text(value)
    where %= len(text) + 1
    raw = encoded(encoding, text[:where] + garbage + text[where:])
    body, why = read_json(raw, encoding, limit)
    if why is not None:
        assert body is None and isinstance(why, str) and why
    else:
        assert limit is None or len(raw) <= limit


@campaign_test
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=HOSTILE_JSON | DEEP, garbage=st.sampled_from([b"", b"\xff", b"\x00", b"}"]), where=st.integers(0, 10**6))
def test_any_hostile_body_through_the_proxy_is_answered_and_stored_once(campaign, value, garbage, where):
    """Property-based, through the campaign's proxy: the engine's answer, and one row that says why."""
    text = json_text(value)
    where %= len(text) + 1
    case = Case(f"p-{uuid.uuid4().hex[:12]}", "openai.chat", chat(text[:where] + garbage + text[where:]))
    outcome, engine_status = send(campaign.proxy, case), direct(campaign.proxy, case)
    campaign.outcomes[case.name] = outcome
    assert outcome.problem is None and outcome.status is not None, outcome.problem
    rows = wait_until(lambda: stored_rows(campaign.proxy, case.name).get(case.name), what=f"the row of {case.name}")
    assert len(rows) == 1, rows
    if received(campaign, case) == "untouched":
        assert outcome.status == engine_status
        assert any(NOT_READ in n for n in rows[0]["notes"]), rows[0]["notes"]
    assert rows[0]["status"] == "ok" or rows[0]["error"]


@pytest.mark.parametrize("translate", [False, True])
def test_an_event_that_never_ends_is_passed_on_unread(translate):
    """An engine event longer than the limit (it may never end): the tap keeps no more than the limit of it and
    passes the bytes on as they come (a translated stream, which cannot, ends there); the step says so."""
    from stepmill.addon.stream_tap import StreamTap

    tap = StreamTap(rewrite=lambda payload: False, markers=("token_ids",), limit=1000,
                    translate=(lambda event: b"translated\n") if translate else None)
    first = b'data: {"token_ids": [1]}\n\n'
    endless = [b'data: {"token_ids": [' + b"1, " * 300] + [b"2, " * 300] * 10
    sent = [part for chunk in [first, *endless, b""] for part in tap(chunk)]
    assert len(tap.decoder.buffer) <= 2000 and len(tap.raw) <= 1000
    if translate:
        assert sent == [b"translated\n"] and "could not be translated further" in tap.notes[0]
    else:
        assert b"".join(sent) == first + b"".join(endless) and "passed on as they came" in tap.notes[0]


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_a_bomb_is_decoded_no_further_than_the_limit(encoding):
    """256 MiB in a few hundred KB (brotli: in 538 bytes): decoding stops at the limit, in time and memory."""
    import tracemalloc

    raw, limit = bomb(encoding), 4 << 20
    tracemalloc.start()
    try:
        started = time.time()
        data, _, problem, cut = decode_kept(raw, encoding, None, limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * limit, f"{peak >> 20} MiB made to decode {limit >> 20} MiB of a bomb of {BOMB >> 20} MiB"
    assert cut and problem is None and len(data) == limit
    body, why = read_json(raw, encoding, limit)
    assert body is None and f"decodes ({encoding}) to more than" in why
    assert time.time() - started < 5
