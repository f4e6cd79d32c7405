"""No unverified weights served: a version whose checkpoint is not what the trainer holds fails the probe
while generation is paused, and nobody samples from it.

The real closed loop in async mode on the real vLLM (dev mode, stepmill's worker extension), white-box
runs rolling out the whole time, and beside them a host client that keeps a greedy call in the engine
at every moment (so a call is held across each sync). The fault: the checkpoint written for version 1
is the trainer's weights with noise added (a wrong file, as a bad write or a mismatched conversion gives).
The run must stop with the probe's reason, the engine must never answer from those weights, and no
step of version 1 may be stored or consumed.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stepmill.errors import SyncError
from stepmill.store import Store

from .real_engine import missing
from .test_train_loop import rollout_file

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(1200)]

TOLERANCE = 1e-4
PROMPT = [9707, 11, 1879, 0, 3555, 374, 220, 17, 10, 17, 30]  # a few Qwen2 ids
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("torch")
    from stepmill.demo.main import start_vllm, vllm_python

    if vllm_python() is None:
        missing("vLLM is not installed: run .ci/install-engines")
    server = start_vllm(tmp_path_factory.mktemp("weights"), dev_mode=True, worker_extension=True,
                        max_new_tokens=16, timeout=900)
    yield server
    server.stop()


class HostClient:
    """A host process's calls straight to the engine, one after another on each of two threads: every
    answer's token ids and logprobs (a greedy continuation of PROMPT; none when vLLM aborted the call),
    and the errors."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.answers: list[tuple[list[int], list[float]]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(2)]

    def ask(self, timeout: float = 60) -> tuple[list[int], list[float]]:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(f"{self.url}/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with DIRECT.open(request, timeout=timeout) as response:
            choice = json.loads(response.read())["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.answers.append(self.ask(timeout=10))
            except (OSError, KeyError, TypeError, ValueError) as exc:  # aborted, or held past the timeout
                self.errors.append(repr(exc))

    def __enter__(self) -> "HostClient":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def write_wrong_checkpoint(model, bad_folder_name: str) -> None:
    """The trainer's save, except that the folder named ``bad_folder_name`` gets every tensor plus noise."""
    import torch
    from safetensors.torch import load_file, save_file

    real_save = model.save_pretrained

    def save(folder, **options):
        real_save(folder, **options)
        if Path(folder).name == bad_folder_name:
            for file in Path(folder).glob("*.safetensors"):
                generator = torch.Generator().manual_seed(7)
                tensors = {k: v + torch.randn(v.shape, generator=generator) * 0.05 for k, v in load_file(file).items()}
                save_file(tensors, str(file), metadata={"format": "pt"})

    model.save_pretrained = save


def test_weights_that_fail_the_probe_are_never_served_in_async_mode(engine, tmp_path):
    from stepmill.runner.config import load
    from stepmill.runner.proxy_handle import ProxyHandle
    from stepmill.train.config import load_train
    from stepmill.train.loop import Loop

    path = rollout_file(tmp_path, engine, agent="white-box", tasks=1, n=2, iterations=1, control=False,
                        mode="async", max_staleness=1)
    config, train = load(path), load_train(path)
    db = tmp_path / "stepmill.db"
    proxy = ProxyHandle(config, str(db))
    client = HostClient(engine.url, engine.name)
    try:
        loop = Loop(config, train, proxy, run="train", update=True, progress=False)
        write_wrong_checkpoint(loop.policy.model, "full-1.partial")  # save_weights writes there, then renames
        try:
            with client, pytest.raises(SyncError) as caught:
                client.answers.append(client.ask())  # the engine's start weights: version 0's
                loop.run_async()
        finally:
            loop.close()
    finally:
        proxy.close()

    # the engine never answered from version 1's weights: every answer is version 0's greedy continuation
    reference_ids, reference_logprobs = client.answers[0]
    served_wrong = [a for a in client.answers if a[0] != reference_ids[:len(a[0])]
                    or max((abs(x - y) for x, y in zip(a[1], reference_logprobs)), default=0.0) > 1e-3]
    assert not served_wrong, (f"the engine answered {len(served_wrong)} of {len(client.answers)} host calls from "
                              f"the weights of version 1, which failed the probe: {served_wrong[:2]}")
    # no step of version 1 stored, none consumed; version 0 alone was trained on and recorded
    store = Store(str(db), readonly=True)
    stamped = store.query("SELECT policy_version, count(*) AS n FROM steps GROUP BY policy_version")
    assert all(row["policy_version"] in ("0", None) for row in stamped), f"steps stored as version 1: {stamped}"
    consumed = store.consumption_staleness(channel="train")
    assert consumed and all(row["policy_version"] == "0" for row in consumed), consumed
    assert [row["version"] for row in store.train_metrics("train")] == [0]
    # the run stopped with the probe's reason
    assert caught.value.version == "1" and caught.value.gap > 100 * TOLERANCE, caught.value
    assert "weight version 1 is not what the engine holds" in str(caught.value)
    assert "generation is left paused" in str(caught.value)
    # a host call was held across the failed sync (the case this test is about), then aborted unanswered
    assert any(not ids for ids, _ in client.answers), "no host call was held when the probe failed"
    # the engine still holds the weights, paused, and never announced them
    sync = loop.engine
    assert sync.is_paused() and sync.weight_version() == "0"
    sync.resume()  # hand the engine back as it was found (a later test may use it)
