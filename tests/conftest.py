"""Real parts, really started: the test upstream, `stepmill proxy` (mitmproxy + addon), SDK clients."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from stepmill.children import free_port
from stepmill.store import Store

from .upstream import Upstream

TESTS = Path(__file__).parent
STEPMILL = [sys.executable, "-m", "stepmill.cli"]
# The Qwen2 tokenizer is built once per test session, never in the user's own cache.
os.environ.setdefault("STEPMILL_CACHE", tempfile.mkdtemp(prefix="stepmill-test-cache-"))
# Property tests check what they generate, not how fast: on a machine busy with other work (CI's is) a
# generated case may take seconds, which is no failure of the code under test.
settings.register_profile("stepmill", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("stepmill")


def wait_until(check, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def http_json(method: str, url: str, body=None, *, raw: bytes | None = None, proxy: str | None = None):
    """A plain HTTP call (no SDK): returns (status, parsed JSON)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    handlers = [urllib.request.ProxyHandler({"http": proxy} if proxy else {})]
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(request, timeout=15) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@dataclass
class Proxy:
    port: int
    reverse_port: int
    control_port: int
    db: Path
    confdir: Path
    env: dict
    upstream: Upstream
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        """The write token the proxy created in its confdir (what a trainer is given)."""
        return (self.confdir / "stepmill-token").read_text().strip()

    def client(self, **kwargs):
        from stepmill.client import StepmillClient

        return StepmillClient(proxy=self.url, confdir=str(self.confdir), **kwargs)

    def store(self) -> Store:
        return Store(self.db)

    def steps(self, where: str, params=(), *, count: int = 1, timeout: float = 15.0) -> list[dict]:
        """Exported steps matching ``where`` once at least ``count`` are written."""
        store = self.store()
        try:
            wait_until(lambda: len(store.query(f"SELECT id FROM steps s WHERE {where}", params)) >= count,
                       timeout=timeout, what=f"{count} steps where {where} {params}")
            return list(store.iter_steps(where, params))
        finally:
            store.close()

    def trajectory_steps(self, trajectory_id: str, count: int) -> list[dict]:
        steps = self.steps("s.trajectory_id = ?", [trajectory_id], count=count)
        return sorted(steps, key=lambda s: s["step_index"])


def start_proxy(tmp: Path, upstream: Upstream, *extra: str) -> Proxy:
    """The proxy most tests use: forward, and reverse to the test upstream, which public API hosts reach."""
    return launch_proxy(tmp, f"https://127.0.0.1:{upstream.port}", "-s", str(TESTS / "redirect_hosts.py"),
                        "--set", f"test_upstream_port={upstream.port}",
                        "--set", f"ssl_verify_upstream_trusted_ca={upstream.ca}", "--set", "termlog_verbosity=warn",
                        *extra, upstream=upstream)


def launch_proxy(tmp: Path, reverse_to: str, *extra: str, upstream: Upstream | None = None,
                 env: dict | None = None) -> Proxy:
    """`stepmill proxy` with a forward listener, a reverse one to ``reverse_to`` and a control port,
    started and answering; with the variables `stepmill env` gives agents."""
    tmp.mkdir(parents=True, exist_ok=True)
    port, reverse_port, control_port = free_port(), free_port(), free_port()
    confdir, db, log = tmp / "mitm", tmp / "steps.db", tmp / "proxy.log"
    args = STEPMILL + [
        "proxy", "--port", str(port), "--db", str(db), "--confdir", str(confdir),
        "--control-port", str(control_port),
        "--mode", f"regular@{port}",
        "--mode", f"reverse:{reverse_to}@{reverse_port}",
        "--set", "connection_strategy=lazy",
        *extra,
    ]
    process = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp, env=env)
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{control_port}/v1/health") or process.poll() is not None, timeout=60, what="proxy start")
        if process.poll() is not None:
            raise RuntimeError(f"proxy exited: {log.read_text()}")
        exports = subprocess.run(STEPMILL + ["env", "--port", str(port), "--confdir", str(confdir)],
                                 capture_output=True, text=True, check=True).stdout
    except BaseException:
        process.kill()
        raise
    agent_env = {}
    for line in exports.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        agent_env[name] = shlex.split(value)[0]
    return Proxy(port, reverse_port, control_port, db, confdir, agent_env, upstream, process, log)


def addon_failures(log_text: str) -> list[str]:
    """Lines where the addon reported a failed hook or a lost call (mitmproxy may prefix a timestamp)."""
    return [line for line in log_text.splitlines()
            if "stepmill: " in line and ("hook failed" in line or "could not record the failure" in line)]


def stop_proxy(proxy: Proxy) -> None:
    proxy.process.terminate()
    try:
        proxy.process.wait(15)
    except subprocess.TimeoutExpired:
        proxy.process.kill()
    # The addon logs (never raises) when one of its hooks fails; a test run must show none.
    failures = addon_failures(proxy.log.read_text(errors="replace"))
    assert not failures, "the stepmill addon reported failures:\n" + "\n".join(failures)


@pytest.fixture(scope="session")
def upstream(tmp_path_factory) -> Upstream:
    return Upstream(tmp_path_factory.mktemp("upstream")).start()


@dataclass
class SimulatedLLM:
    url: str  # the OpenAI base URL, …/v1
    tokenizer: Path


@pytest.fixture(scope="session")
def simulated_llm(tmp_path_factory):
    """`stepmill simulate-llm`, really started: the demo's engine (real Qwen2 ids)."""
    from stepmill.qwen_vocab import default_folder

    tokenizer = default_folder()
    port = free_port()
    log = tmp_path_factory.mktemp("simulated-llm") / "llm.log"
    process = subprocess.Popen(STEPMILL + ["simulate-llm", "--port", str(port), "--tokenizer", str(tokenizer)],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until(lambda: process.poll() is not None or answers(f"{url}/models"), timeout=120, what="simulated LLM")
        assert process.poll() is None, log.read_text()
        yield SimulatedLLM(url, tokenizer)
    finally:
        process.terminate()
        process.wait(10)


def answers(url: str) -> bool:
    """Something listens at ``url`` (an HTTP error is an answer too)."""
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def proxy(tmp_path_factory, upstream):
    started = start_proxy(tmp_path_factory.mktemp("proxy"), upstream)
    # Agents get the proxy through their environment, as `eval "$(stepmill env)"` gives it.
    saved = {k: os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "SSL_CERT_FILE", "NO_PROXY", "no_proxy")}
    os.environ["HTTPS_PROXY"] = started.env["HTTPS_PROXY"]
    os.environ["https_proxy"] = started.env["https_proxy"]
    os.environ["SSL_CERT_FILE"] = started.env["SSL_CERT_FILE"]
    os.environ.pop("NO_PROXY", None)
    os.environ.pop("no_proxy", None)
    yield started
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    stop_proxy(started)


@pytest.fixture
def marker() -> str:
    """A unique string to find this test's steps by."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def openai_client(proxy):
    import openai

    return openai.OpenAI(api_key="sk-test-secret", base_url="https://api.openai.com/v1", max_retries=0, timeout=30)


@pytest.fixture
def anthropic_client(proxy):
    import anthropic

    return anthropic.Anthropic(api_key="sk-ant-test-secret", base_url="https://api.anthropic.com", max_retries=0,
                               timeout=30)


# The real vLLM (tests/real_engine.py): one server per session, from .engines/vllm (`.ci/install-engines`).

# The fleet's parts, started once for the session: a real PostgreSQL (a new database per test) and a
# local Ray cluster of two nodes.
@pytest.fixture(scope="session")
def postgres():
    from .postgres_server import REQUIRE, missing_reason, start_postgres

    reason = missing_reason()
    if reason:
        if os.environ.get(REQUIRE, "") not in ("", "0"):
            pytest.fail(f"{reason} ({REQUIRE} is set: the fleet's tests never skip here)", pytrace=False)
        pytest.skip(reason)
    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture
def url(postgres):
    """A new, empty database on the test PostgreSQL: the coordinator's URL."""
    return postgres.new_database()


@pytest.fixture
def fleet(url):
    from stepmill.store.fleet_ledger import Coordinator

    with Coordinator(url) as coordinator:
        yield coordinator


RAY_NODES = 2


@dataclass
class RayCluster:
    address: str  # the GCS address, as [run] ray_address takes it


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster of ``RAY_NODES`` nodes (one CPU each), started as `stepmill fleet up` starts
    its own (``stepmill.fleet.local_ray``), this process connected to it; stopped as `fleet down` stops it."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stepmill[fleet]'")
    import shutil

    from stepmill.fleet.local_ray import cluster_processes, ray_down, ray_up, temp_folder

    folder = Path(tempfile.mkdtemp(prefix="stepmill-ray-"))  # short: Ray's sockets lie in it
    try:
        state, _ = ray_up(folder, RAY_NODES, 1)
        ray.init(address=state["address"], log_to_driver=False)
        yield RayCluster(state["address"])
    finally:
        ray.shutdown()
        ray_down(folder)
        left = cluster_processes(temp_folder(folder))
        shutil.rmtree(folder, ignore_errors=True)
        assert not left, f"processes of the test's Ray cluster outlived its stop: {left}"

from .real_engine import vllm  # noqa: E402,F401


# End-to-end modules (a real engine, a Ray cluster, PostgreSQL, the agent CLIs, the whole demo): `make test`
# runs the rest first (`-m "not slow"`), then these (`-m slow`). A new such module marks itself.
SLOW_MODULES = {"test_real_vllm", "test_agent_recipes", "test_ray_rollout", "test_ray_data", "test_fleet",
                "test_fleet_ui", "test_coordinator", "test_demo", "test_workers"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
