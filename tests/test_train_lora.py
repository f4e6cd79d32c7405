"""``[train.lora]``: the trainer trains a LoRA adapter with peft, its base weights frozen, and serves each
version as an adapter the engine loads in place, verified by the probe as the full weights are.

Without an engine: the adapter peft trains is what ``LoraAdapter`` holds (the trainer's logprobs under
the peft model equal the base's with the adapter merged), a step moves the adapter alone, and a
checkpoint keeps the adapter and its optimizer (and is refused by a run that trains the full weights).
On the real vLLM (slow): a short ``train_loop`` with ``[train.lora]``, two versions, each sync verified,
the adapter listed by the engine and called by the rollouts, the engine's base model unchanged, and
every sampled token within the probe's tolerance of the trainer's under the adapter of its version.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import urllib.request
from contextlib import contextmanager

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import get_peft_model_state_dict  # noqa: E402

from stepmill.errors import BadInput, ConfigError  # noqa: E402
from stepmill.train import checkpoint  # noqa: E402
from stepmill.train.config import LoraConfig, TrainConfig  # noqa: E402
from stepmill.train.engine_sync import LoraAdapter, probe_tokens, trainer_logprobs  # noqa: E402
from stepmill.train.policy import Policy  # noqa: E402
from stepmill.train import forward  # noqa: E402
from stepmill.train.micro_batches import claimed_steps, layout_batch  # noqa: E402

from .real_engine import missing  # noqa: E402
from .test_train_layouts import VOCAB, layouts, tiny_qwen2  # noqa: E402,F401  (layouts: the fixture)
from .test_trainer_micro_batches import claimed  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
PROBE = probe_tokens(48, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """The engine's starting weights as a folder (the tiny Qwen2 that sampled the groups)."""
    folder = tmp_path_factory.mktemp("base") / "model"
    tiny_qwen2(seed=0, dtype=torch.float32).save_pretrained(folder)
    return folder


def lora_policy(folder, **train) -> Policy:
    return Policy(TrainConfig(model=str(folder), lr=5e-2, lora=LORA, **train).check())


def base_weights(policy: Policy) -> dict:
    return {k: v.detach().clone() for k, v in policy.model.get_base_model().state_dict().items() if "lora_" not in k}


def test_a_lora_policy_trains_the_adapter_alone(layouts, base_folder):
    store, _ = layouts
    policy = lora_policy(base_folder)
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {id(p) for p in policy.trained} == {id(p) for p in policy.model.parameters() if p.requires_grad}
    before, adapter_before = base_weights(policy), copy.deepcopy(policy.adapter())  # its tensors are the weights
    stats = policy.step(claimed(store), update=True)
    assert stats["unrewarded_steps"] == 0 and stats["grad_norm"] > 0
    after = base_weights(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base frozen
    adapter = policy.adapter()
    assert sorted(adapter.weights) == sorted(adapter_before.weights)
    assert len(adapter.weights) == 4 and adapter.target_modules == ["q_proj", "v_proj"]
    assert (adapter.r, adapter.alpha) == (4, 8)
    moved = [not torch.equal(adapter.weights[m][1], adapter_before.weights[m][1]) for m in adapter.weights]
    assert all(moved)  # every B moved off its zeros


def test_what_the_engine_is_sent_is_what_peft_trains(layouts, base_folder):
    """The trainer's logprobs under the peft model equal the base model's with the converted adapter
    merged (what the engine computes from the adapter's folder); a wrong scale would show."""
    store, _ = layouts
    policy = lora_policy(base_folder)
    policy.step(claimed(store), update=True)
    adapter = policy.adapter()
    base = tiny_qwen2(seed=0, dtype=torch.float32)
    peft_side = trainer_logprobs(policy.model, PROBE)
    merged = trainer_logprobs(base, PROBE, lora=adapter)
    assert max(abs(a - b) for a, b in zip(peft_side, merged)) < 1e-5
    assert max(abs(a - b) for a, b in zip(peft_side, trainer_logprobs(base, PROBE))) > 1e-4  # it did move
    doubled = LoraAdapter(adapter.r, adapter.alpha * 2, adapter.weights)
    assert max(abs(a - b) for a, b in zip(peft_side, trainer_logprobs(base, PROBE, lora=doubled))) > 1e-5


def test_the_kl_reference_is_the_base_under_the_adapter_not_a_copy(layouts, base_folder):
    """With ``kl`` set, the reference of a LoRA policy is the policy with its adapter off: its logprobs
    are the starting weights' after the adapter has moved, and no second model is held."""
    store, _ = layouts
    policy = lora_policy(base_folder, kl=0.1)
    assert isinstance(policy.reference, forward.AdapterOff) and policy.reference.model is policy.model
    first = policy.step(claimed(store), update=True)
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # B starts at zeros: the policy is its reference
    batch = layout_batch(claimed_steps(claimed(store)), "steps", 0)
    chunk = batch.chunks[0]
    reference = forward.reference_logprobs(policy.reference, chunk, "steps")
    with torch.no_grad():
        base = forward.token_view(tiny_qwen2(seed=0, dtype=torch.float32), chunk, "steps").logprobs
        moved = forward.token_view(policy.model, chunk, "steps").logprobs
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-5)
    assert (moved - base).abs().max() > 1e-4  # the adapter moved, and the reference did not follow
    assert policy.model.training and all(p.requires_grad for p in policy.trained)  # the adapter back on, to train
    adapter_before = copy.deepcopy(policy.adapter())
    second = policy.step(claimed(store), update=True)
    assert second["kl"] > 0 and second["grad_norm"] > 0
    assert all(not torch.equal(policy.adapter().weights[m][1], b) for m, (_, b) in adapter_before.weights.items())
    with pytest.raises(BadInput, match="AdapterOff"):  # the live adapter as its own reference: a KL of 0
        forward.reference_logprobs(policy.model, chunk, "steps")


def test_a_checkpoint_keeps_the_adapter_and_its_optimizer(layouts, base_folder, tmp_path):
    store, _ = layouts
    policy = lora_policy(base_folder)
    policy.step(claimed(store), update=True)
    path = checkpoint.save(tmp_path, version=1, model=policy.model, optimizer=policy.optimizer, groups=["g1"],
                           metrics={}, resumes=0)
    state = torch.load(path, weights_only=False)
    assert state["lora"] and state["model"] and all("lora_" in k for k in state["model"])  # the adapter alone
    resumed = lora_policy(base_folder)
    checkpoint.restore(state, resumed.model, resumed.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(resumed.adapter().weights.values(), policy.adapter().weights.values())
               for a, b in zip(a, b))
    # the next step from the checkpoint is the uninterrupted one's
    policy.step(claimed(store), update=True)
    resumed.step(claimed(store), update=True)
    for module, (a, b) in policy.adapter().weights.items():
        torch.testing.assert_close(resumed.adapter().weights[module][0], a, rtol=0, atol=1e-7)
        torch.testing.assert_close(resumed.adapter().weights[module][1], b, rtol=0, atol=1e-7)
    full = Policy(TrainConfig(model=str(base_folder)).check())
    with pytest.raises(ConfigError, match="checkpoint holds a LoRA adapter, and \\[train\\] now trains the full"):
        checkpoint.restore(state, full.model, full.optimizer)


def test_a_target_module_the_model_lacks_is_refused(base_folder):
    with pytest.raises(ConfigError, match=r"\[train.lora\] target_modules: .*qkv_proj"):
        Policy(TrainConfig(model=str(base_folder), lora=LoraConfig(target_modules=("qkv_proj",))).check())


def test_async_snapshots_keep_the_adapter_of_each_version(layouts, base_folder):
    """Async: a version's adapter is kept while its groups may be trained on, and the gap of a step stamped
    with it is measured under it (the base is not copied)."""
    store, _ = layouts
    policy = lora_policy(base_folder, mode="async", max_staleness=1)
    policy.serving(0)
    assert all("lora_" in k for k in policy.snapshots[0])
    before = copy.deepcopy(policy.adapter().weights)
    policy.step(claimed(store), update=True)
    policy.serving(1)
    policy.sample_gap(claimed_steps(claimed(store)))  # loads version 0's adapter for a moment, then puts version 1's back
    assert any(not torch.equal(policy.adapter().weights[m][1], before[m][1]) for m in before)
    assert all(torch.equal(policy.snapshots[1][k], v) for k, v in get_peft_model_state_dict(policy.model).items())


# ------------------------------------------------------------------------------ on the real vLLM

@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory, request):
    """vLLM serving the untied warm-started Qwen2 (its topic_words rewards vary within a group, so a step
    has advantages to move the adapter by) with runtime LoRA adapters of rank up to 8."""
    from stepmill.demo.main import start_vllm, vllm_python

    if vllm_python() is None:
        missing("vLLM is not installed: run .ci/install-engines")
    server = start_vllm(tmp_path_factory.mktemp("lora-engine"), tied=False, warm_start=True, dev_mode=True,
                        worker_extension=True, enable_lora=True, max_lora_rank=8, max_new_tokens=32, timeout=900)
    yield server
    server.stop()
    if request.session.testsfailed:
        sys.__stderr__.write(f"\n--- the real vLLM's log ({server.log}), last lines:\n{server.log_tail()}\n")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_lora_run_on_the_real_vllm(lora_engine, tmp_path):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from stepmill.runner.config import load
    from stepmill.store import Store
    from stepmill.train.config import load_train
    from stepmill.train.engine_sync import VLLMSync, vllm_logprobs
    from stepmill.train.loop import train_loop

    from .test_train_loop import rollout_file

    path = rollout_file(tmp_path, lora_engine, agent="black-box", tasks=2, n=4, iterations=2, control=False, lr=2e-2)
    path.write_text(path.read_text() + '\n[train.lora]\nrank = 8\nalpha = 16\ntarget_modules = ["q_proj", "v_proj"]\n')
    db = tmp_path / "stepmill.db"
    adapter_name = LoraConfig.served_name(lora_engine.name, "train")
    with models_seen(lora_engine.url) as listed:  # what /v1/models lists while the run goes on
        outcome = train_loop(load(path), load_train(path), db=str(db), progress=False)
    print("LoRA run:", [(r.version, {k: r.metrics.get(k) for k in ("logprob_gap", "rollout_gap", "sync_s",
                                                                   "engine_paused_s", "train_s", "reward")})
                        for r in outcome.run])
    assert adapter_name in listed
    assert all(r.metrics["grad_norm"] > 0 for r in outcome.run[:2]), "no step had an advantage to train on"

    assert [r.version for r in outcome.run] == [0, 1, 2]
    for report in outcome.run:  # every sync verified in the paused engine, every sampled token checked
        m = report.metrics
        assert m["logprob_gap"] <= 1e-4, (report.version, m)
        if "rollout_gap" in m:
            assert m["rollout_gap"] <= 1e-4 and not m["rollout_gap_unchecked"], (report.version, m)
            assert m["unrewarded_steps"] == 0
    sync = VLLMSync(lora_engine.url, lora_engine.name)
    assert sync.weight_version() == "2"
    # the run's end unloads its adapter (its folder goes with the run), and the engine serves on
    assert served_models(lora_engine.url) == {lora_engine.name}
    store = Store(str(db), readonly=True)
    models = {row["model"] for row in store.query("SELECT DISTINCT model FROM steps WHERE channel = 'train'")}
    assert models == {adapter_name}  # every rollout called the adapter

    # the engine's base model is still the starting weights; the last checkpoint's adapter moved off them
    base = AutoModelForCausalLM.from_pretrained(lora_engine.model_dir, dtype=torch.float32)
    probe = probe_tokens(64)
    base_side = trainer_logprobs(base, probe)
    assert max(abs(a - b) for a, b in zip(base_side, vllm_logprobs(lora_engine.url, lora_engine.name, probe))) <= 1e-4
    state = checkpoint.latest(checkpoint.checkpoint_folder(str(db), "train"))
    assert state["version"] == 2 and state["lora"] and all("lora_" in k for k in state["model"])
    trained = get_peft_model(base, PeftLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    set_peft_model_state_dict(trained, state["model"])
    assert max(abs(a - b) for a, b in zip(trainer_logprobs(trained, probe), base_side)) > 1e-3


def served_models(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/models") as answer:
        return {card["id"] for card in json.loads(answer.read())["data"]}


@contextmanager
def models_seen(url: str, every: float = 0.5):
    """Every model id the engine's /v1/models listed while the block ran (polled in a thread)."""
    seen: set[str] = set()
    stop = threading.Event()

    def poll():
        while not stop.wait(every):
            try:
                seen.update(served_models(url))
            except OSError:
                pass

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield seen
    finally:
        stop.set()
        poller.join()
