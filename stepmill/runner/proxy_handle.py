"""The proxy a rollout's runs go through: the configured one, one started for the rollout, or one a node
started (reached again by its address from a run's Ray task on that node)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from stepmill.children import die_with_parent, free_port
from stepmill.client import StepmillClient
from stepmill.private_files import private_opener
from stepmill.runner.config import Config, EngineRoute
from stepmill.runner.proxy_env import agent_env, trust_env
from stepmill.tags import tag_path


class ProxyHandle:
    """The proxy the runs go through: the configured one, or one started for the rollout."""

    def __init__(self, config: Config, db: str | None):
        proxy, route = config.proxy, config.route
        self.process = None
        self.reverse_url = None
        self.confdir = os.path.expanduser(proxy.get("confdir", "~/.mitmproxy"))
        self.db = db or proxy.get("db") or "stepmill.db"
        if proxy.get("url"):
            self.url = proxy["url"]
        else:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            args = ["--mode", f"regular@{port}"]
            if route.engines:
                args += ["--set", f"stepmill_engine_hosts={','.join(route.engines)}"]
            if route.reverse:  # agents that only take a base URL get a tagged one on a second port
                reverse_port = free_port()
                args += ["--mode", f"reverse:{origin(route.base_url)}@{reverse_port}"]
                self.reverse_url = f"http://127.0.0.1:{reverse_port}"
            self.log = Path(tempfile.gettempdir()) / f"stepmill-rollout-proxy-{port}.log"
            with open(self.log, "wb", opener=private_opener) as log:  # it names the runner's files
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "stepmill.cli", "proxy", "--port", str(port), "--db", self.db,
                     "--confdir", self.confdir, *args, *proxy.get("args", [])], stdout=log,
                    stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self._connect()
        deadline = time.time() + 60
        while True:
            try:
                self.client.health()
                break
            except OSError:
                if time.time() > deadline or (self.process and self.process.poll() is not None):
                    self.close()
                    where = f" (its log: {self.log})" if self.process else ""
                    raise RuntimeError(f"the proxy at {self.url} does not answer{where}") from None
                time.sleep(0.2)

    @classmethod
    def reached(cls, *, url: str, reverse_url: str | None, confdir: str, db: str) -> "ProxyHandle":
        """A proxy another process of this machine started and keeps (a node's): used, never stopped."""
        handle = cls.__new__(cls)
        handle.process, handle.url, handle.reverse_url, handle.confdir, handle.db = None, url, reverse_url, confdir, db
        handle._connect()
        return handle

    def _connect(self) -> None:
        from stepmill.auth.write_token import ensure_token

        ensure_token(self.confdir)  # a proxy started here creates it too; the client reads it now
        # Longer than the proxy's commit barrier (60 s): a complete that waits for it is answered first.
        self.client = StepmillClient(proxy=self.url, confdir=self.confdir, timeout=150)

    def env(self, trajectory: str, secret: str, route: EngineRoute, bundle: Path) -> dict:
        """A black-box run's environment: credentials with the run's secret and the CA, or a reverse
        base URL carrying them."""
        if route.reverse and self.reverse_url:  # the credentials ride in the URL; nothing else goes through a proxy
            path = urllib.parse.urlsplit(route.base_url).path.rstrip("/")
            base_url = f"{self.reverse_url}{tag_path(trajectory, secret=secret)}{path}"
            return {"OPENAI_BASE_URL": base_url, "OPENAI_API_BASE": base_url, **trust_env(str(bundle))}
        parts = urllib.parse.urlsplit(self.url)
        env = agent_env(parts.hostname, parts.port, self.confdir, trajectory, secret=secret, bundle=str(bundle))
        if route.base_url:  # what the openai SDK, litellm and most OpenAI-compatible clients read
            env.update(OPENAI_BASE_URL=route.base_url, OPENAI_API_BASE=route.base_url)
        return env

    def close(self):
        stop_process(self.process, 30)


def stop_process(process: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM (a proxy commits what it holds and stops its writer), SIGKILL after ``grace`` seconds."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()


def origin(base_url: str | None) -> str:
    """scheme://host:port of a base URL (what Anthropic clients take as ANTHROPIC_BASE_URL)."""
    if not base_url:
        return ""
    parts = urllib.parse.urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}"
