"""The engine probe goes the way the flow goes: behind `--mode upstream:…`, a host only the upstream
proxy can reach is still probed (through it) and asked for exact ids."""

import subprocess
import sys
import urllib.parse

import httpx2
import openai

from .conftest import STEPMILL, free_port, wait_until

UPSTREAM_SCRIPT = """
from mitmproxy import ctx

class Route:
    def load(self, loader):
        loader.add_option("engine_port", int, 0, "")

    def request(self, flow):
        if flow.request.pretty_host == "vllm.internal":  # a name only this proxy can resolve
            flow.request.host, flow.request.port = "127.0.0.1", ctx.options.engine_port
            flow.request.host_header = "vllm.internal"

addons = [Route()]
"""


def listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_the_probe_follows_an_upstream_proxy(tmp_path, simulated_llm, marker):
    engine_port = urllib.parse.urlsplit(simulated_llm.url).port
    script = tmp_path / "route.py"
    script.write_text(UPSTREAM_SCRIPT)
    corp, ours = free_port(), free_port()
    mitmdump = str(__import__("pathlib").Path(sys.executable).with_name("mitmdump"))
    corp_proxy = subprocess.Popen([mitmdump, "--listen-port", str(corp), "-s", str(script), "--set",
                                   f"engine_port={engine_port}", "-q"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.STDOUT)
    log = tmp_path / "proxy.log"
    proxy = subprocess.Popen(STEPMILL + ["proxy", "--db", str(tmp_path / "s.db"), "--confdir", str(tmp_path / "mitm"),
                                         "--port", str(ours), "--mode", f"upstream:http://127.0.0.1:{corp}"],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: listening(ours) or proxy.poll() is not None, timeout=60, what="proxy")
        client = openai.OpenAI(api_key="sk-x", base_url="http://vllm.internal/v1", max_retries=0,
                               http_client=httpx2.Client(proxy=f"http://127.0.0.1:{ours}", trust_env=False))
        reply = client.chat.completions.create(model="qwen-sim", messages=[
            {"role": "user", "content": f"[{marker}] What is 2 + 2?"}])
        assert (reply.choices[0].model_extra or {}).get("token_ids") is None
        from stepmill.store import Store

        def step():
            rows = Store(str(tmp_path / "s.db"), readonly=True).query(
                "SELECT token_provenance, host FROM steps WHERE messages_suffix LIKE ?", [f"%{marker}%"])
            return rows[0] if rows else None

        found = wait_until(step, timeout=15, what="the step")
        assert found == {"token_provenance": "exact", "host": "vllm.internal"}, log.read_text()[-2000:]
        assert "engine probe" not in log.read_text() or "failed" not in log.read_text()
    finally:
        for process in (proxy, corp_proxy):
            process.terminate()
            process.wait(30)
