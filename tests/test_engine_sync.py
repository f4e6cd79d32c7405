"""The engine serves each new policy in place, verified: the real vLLM (dev mode, stepmill's worker
extension) reloads a trainer's weights or a LoRA adapter, and a fixed probe's logprobs, computed inside
the paused engine, match the trainer's to 1e-4 before generation resumes (and match what vLLM serves
over HTTP). Tied and untied embeddings; vLLM's own reload keeps a tied lm_head stale, and the probe
keeps it from being served.

Two servers, one at a time: a tied model, and an untied one that also serves LoRA adapters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stepmill.errors import ConfigError, SyncError
from stepmill.train.engine_sync import (
    ADMIN_ROUTES, PAUSED_PHASES, LoraAdapter, VLLMSync, applied_lora, is_admin_route, probe_tokens, save_lora,
    trainer_logprobs, version_folder, vllm_logprobs, weights_root,
)

from .real_engine import missing

TOLERANCE = 1e-4
PROMPT = [9707, 11, 1879, 0, 3555, 374, 220, 17, 10, 17, 30]  # a few Qwen2 ids


# ------------------------------------------------------------------------------ without a server

def test_admin_routes_cover_the_query_string_and_trailing_slash():
    assert is_admin_route("/collective_rpc")
    assert is_admin_route("/pause?mode=wait")
    assert is_admin_route("/v1/load_lora_adapter/")
    assert not is_admin_route("/v1/completions")
    assert not is_admin_route("/v1/chat/completions")
    assert not is_admin_route("/v1/models")


def test_a_version_is_a_name_not_a_path(tmp_path):
    assert version_folder(tmp_path, "step-12.3") == tmp_path / "full-step-12.3"
    for bad in ("../up", "a/b", "", ".hidden", "x" * 129):
        with pytest.raises(ConfigError):
            version_folder(tmp_path, bad)


def test_weights_fall_back_beside_the_run_when_shared_memory_is_too_small(tmp_path):
    root = weights_root(tmp_path, need_bytes=1 << 60)
    assert root.parent == tmp_path and root.is_dir()
    assert oct(root.stat().st_mode & 0o777) == "0o700"


def test_the_probe_is_fixed():
    assert probe_tokens() == probe_tokens()
    assert len(probe_tokens()) == 256 and max(probe_tokens()) < 151643
    assert probe_tokens(seed=1) != probe_tokens()


# ------------------------------------------------------------------------------ with torch and vLLM

@pytest.mark.torch
def test_admin_routes_hold_every_route_vllm_opens_in_dev_mode():
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.entrypoints.rl.online.api_router import router as rl
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc
    from vllm.entrypoints.serve.dev.server_info.api_router import router as info
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep

    paths = {route.path for router in (rl, cache, rpc, info, sleep) for route in router.routes}
    assert {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version"} <= paths
    assert paths - set(ADMIN_ROUTES) == set()


@pytest.mark.torch
def test_a_lora_folder_is_what_vllm_reads(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    adapter = _adapter(torch, seed=0)
    folder = save_lora(adapter, tmp_path / "lora-v1", base_model="m")
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    assert (helper.r, helper.lora_alpha, sorted(helper.target_modules)) == (8, 16, ["q_proj", "v_proj"])
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        names = {parse_fine_tuned_lora_name(key) for key in f.keys()}
    assert ("model.layers.0.self_attn.q_proj", True) in names and ("model.layers.1.self_attn.v_proj", False) in names
    assert not (tmp_path / "lora-v1.partial").exists()


# The servers: dev mode, the worker extension; LoRA on the untied one.

def _start(tmp_path_factory, request, name: str, *, tied: bool, lora: bool, dtype: str = "float32"):
    from stepmill.demo.main import ENGINE_INSTALL, start_vllm, vllm_python
    from stepmill.qwen_vocab import default_folder

    python = vllm_python()
    if python is None:
        missing(f"vLLM is not installed: run {ENGINE_INSTALL} (it makes .engines/vllm)")
    try:
        server = start_vllm(tmp_path_factory.mktemp(name), tokenizer=default_folder(), python=python, timeout=900,
                            tied=tied, dev_mode=True, worker_extension=True, enable_lora=lora, max_lora_rank=8,
                            dtype=dtype)
    except RuntimeError as exc:
        pytest.fail(f"the real vLLM did not start: {exc}", pytrace=False)
    return server


def _stop(server, request) -> None:
    failed = request.session.testsfailed
    server.stop()
    if failed:
        sys.__stderr__.write(f"\n--- the real vLLM's log ({server.log}), last lines:\n{server.log_tail()}\n")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, request):
    """One server at a time (pytest runs a module-scoped parameter's tests together): "tied", "untied",
    which also serves LoRA adapters, or "tied-bf16", the tied model served in bfloat16."""
    pytest.importorskip("torch")
    kind = request.param
    server = _start(tmp_path_factory, request, kind, tied=kind.startswith("tied"), lora=kind == "untied",
                    dtype="bfloat16" if kind.endswith("bf16") else "float32")
    yield server
    _stop(server, request)


BOTH = pytest.mark.parametrize("engine", ["tied", "untied"], indirect=True)
TIED = pytest.mark.parametrize("engine", ["tied"], indirect=True)
UNTIED = pytest.mark.parametrize("engine", ["untied"], indirect=True)
BF16 = pytest.mark.parametrize("engine", ["tied-bf16"], indirect=True)


@pytest.fixture
def syncs(tmp_path):
    made: list[VLLMSync] = []

    def make(server, **options) -> VLLMSync:
        made.append(VLLMSync(server.url, server.name, run_dir=tmp_path, timeout=120, **options))
        return made[-1]

    yield make
    for sync in made:
        sync.close()


def _model(server):
    torch = pytest.importorskip("torch")
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(server.model_dir, torch_dtype=torch.float32)
    return torch, model


def _train(torch, model, seed: int, steps: int = 3, lr: float = 2.0) -> None:
    """A few SGD steps pulling the model toward a random continuation of PROMPT."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 151643, (8,), generator=generator).tolist()
    ids = torch.tensor([PROMPT + target])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    model.eval()


def _noise(torch, model, seed: int, scale: float = 0.02) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def _answer(server, model_name: str, tokens: int = 6) -> tuple[list[int], list[float]]:
    """The engine's greedy continuation of PROMPT: its token ids and their logprobs."""
    import urllib.request

    body = {"model": model_name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    request = urllib.request.Request(f"{server.url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=120) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _greedy(torch, model, tokens: int = 6) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def _timings(request, report) -> None:
    request.node.user_properties.append(("sync", report.as_dict()))
    print(f"\n{request.node.name}: {json.dumps(report.as_dict())}")


def _adapter(torch, seed: int) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            a = torch.randn(8, 128, generator=generator) * 0.1
            b = torch.randn(128, 8, generator=generator) * 0.1
            weights[f"model.layers.{layer}.self_attn.{module}"] = (a, b)
    return LoraAdapter(r=8, alpha=16, weights=weights)


# ------------------------------------------------------------------------------ full weights

@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)
@BOTH
def test_each_version_is_served_in_place_and_verified(engine, syncs, request):
    torch, model = _model(engine)
    sync = syncs(engine)
    base = sync.sync(model, "base")  # earlier tests may have left other weights
    assert base.gap <= TOLERANCE
    before = _answer(engine, engine.name)

    _train(torch, model, seed=1)
    first = sync.sync(model, "step-1")
    _timings(request, first)
    assert first.gap <= TOLERANCE
    assert {"pause", "reload", "probe_engine", "reset_cache", "version", "resume"} <= set(first.seconds)
    assert "probe_engine" in PAUSED_PHASES  # checked before generation resumes
    assert first.paused_seconds == round(sum(first.seconds[k] for k in PAUSED_PHASES if k in first.seconds), 4)
    assert sync.weight_version() == "step-1"
    assert not sync.is_paused()
    # the in-place probe reads what the engine serves: vLLM's own prompt logprobs over HTTP, to the tolerance
    assert sync.engine_logprobs() == pytest.approx(vllm_logprobs(engine.url, engine.name, sync.probe), abs=TOLERANCE)
    after = _answer(engine, engine.name)
    assert after != before  # the engine answers with the new policy ...
    assert after[0] == _greedy(torch, model)  # ... the trainer's own greedy continuation
    assert Path(first.path).is_dir() and not Path(base.path).exists()  # the old version's folder is gone

    _noise(torch, model, seed=2)
    second = sync.sync(model, "step-2")
    _timings(request, second)
    assert second.gap <= TOLERANCE
    assert sync.weight_version() == "step-2"
    assert not Path(first.path).exists()


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)
@BOTH
def test_weights_that_were_not_reloaded_fail_the_probe_loudly(engine, syncs):
    torch, model = _model(engine)
    sync = syncs(engine)
    sync.sync(model, "base")
    _noise(torch, model, seed=3)
    with pytest.raises(SyncError, match=r"weight version unsynced .* differ .* by up to") as caught:
        sync.verify(model, "unsynced")  # the trainer moved on, the engine did not
    assert caught.value.version == "unsynced" and caught.value.gap > 100 * TOLERANCE
    assert sync.is_paused()  # it serves nobody the wrong policy
    assert sync.sync(model, "synced").gap <= TOLERANCE
    assert not sync.is_paused()


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)
@TIED
def test_vllms_own_reload_keeps_a_tied_lm_head_stale(engine, syncs, request):
    """vLLM 0.32's reload_weights reloads embed_tokens but not the tied lm_head's kernel state (the
    CPU build's prepacked GEMM): the probe sees it. stepmill's worker extension re-ties it."""
    torch, model = _model(engine)
    assert model.config.tie_word_embeddings
    with pytest.raises(ConfigError, match="tied"):
        syncs(engine, reload="vllm").sync(model, "refused")
    syncs(engine).sync(model, "base")  # earlier tests may have left other weights
    plain = syncs(engine, reload="vllm", allow_stale_tied=True)
    _noise(torch, model, seed=4)
    with pytest.raises(SyncError, match="weight version stale .* left paused") as caught:
        plain.sync(model, "stale")
    request.node.user_properties.append(("stale_tied_gap", caught.value.gap))
    print(f"\nvLLM's own reload on a tied model: probe gap {caught.value.gap:.4f}")
    assert caught.value.gap > 100 * TOLERANCE
    # caught while paused: never resumed, never announced
    assert plain.is_paused() and plain.weight_version() == "base"
    fixed = syncs(engine).sync(model, "retied")
    assert fixed.gap <= TOLERANCE


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)
@UNTIED
def test_vllms_own_reload_serves_an_untied_model(engine, syncs):
    torch, model = _model(engine)
    assert not model.config.tie_word_embeddings
    sync = syncs(engine, reload="vllm")
    _noise(torch, model, seed=5)
    assert sync.sync(model, "plain").gap <= TOLERANCE


# ------------------------------------------------------------------------------ LoRA

@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)
@UNTIED
def test_a_lora_adapter_is_loaded_in_place_and_verified(engine, syncs, request):
    torch, model = _model(engine)
    sync = syncs(engine)
    sync.sync(model, "base")
    base_answer = _answer(engine, engine.name)

    first = sync.sync_lora(model, _adapter(torch, seed=1), "lora-1", name="policy")
    _timings(request, first)
    assert first.gap <= TOLERANCE
    assert sync.weight_version() == "lora-1"
    served = _answer(engine, "policy")
    assert served != base_answer
    with applied_lora(model, _adapter(torch, seed=1)):
        assert served[0] == _greedy(torch, model)
    # the base model still answers as before, beside the adapter
    assert _answer(engine, engine.name)[0] == base_answer[0]
    assert trainer_logprobs(model, sync.probe) == pytest.approx(
        vllm_logprobs(engine.url, engine.name, sync.probe), abs=TOLERANCE)
    # the adapter probed in place (under its private id) is what the served name gives over HTTP
    assert sync.engine_logprobs(lora_path=Path(first.path)) == pytest.approx(
        vllm_logprobs(engine.url, "policy", sync.probe), abs=TOLERANCE)

    second = sync.sync_lora(model, _adapter(torch, seed=2), "lora-2", name="policy")  # in place, same name
    _timings(request, second)
    assert second.gap <= TOLERANCE
    assert _answer(engine, "policy") != served
    assert not Path(first.path).exists() and Path(second.path).is_dir()

    with pytest.raises(SyncError, match="lora-stale"):
        sync.verify(model, "lora-stale", lora=_adapter(torch, seed=3))  # an adapter never loaded
    sync.resume()

    second_answer = _answer(engine, "policy")
    _noise(torch, model, seed=6)  # the trainer's base moved on, the engine's did not: the adapter's probe fails
    with pytest.raises(SyncError, match="weight version lora-bad .* left paused") as caught:
        sync.sync_lora(model, _adapter(torch, seed=4), "lora-bad", name="policy")
    assert caught.value.gap > 100 * TOLERANCE
    assert sync.is_paused() and sync.weight_version() == "lora-2"  # caught before it was served or announced
    sync.resume()
    again = _answer(engine, "policy")  # the name still serves the last verified adapter
    assert again[0] == second_answer[0] and again[1] == pytest.approx(second_answer[1], abs=TOLERANCE)


# ------------------------------------------------------------------------------ bfloat16 on both sides

@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(900)
@BF16
def test_bf16_on_both_sides_syncs_within_the_bf16_tolerance(engine, syncs, request):
    """The trainer holds the weights in bfloat16 and the engine serves them in bfloat16: each sync's probe
    gap is within the tolerance `[train] dtype = "bfloat16"` gives the probe, and the gap measured is
    recorded (docs/training/index.md states it)."""
    from transformers import Qwen2ForCausalLM

    from stepmill.train.config import TrainConfig

    torch = pytest.importorskip("torch")
    tolerance = TrainConfig(model=str(engine.model_dir), dtype="bfloat16").check().probe_tolerance()
    model = Qwen2ForCausalLM.from_pretrained(engine.model_dir, torch_dtype=torch.bfloat16)
    sync = syncs(engine, tolerance=tolerance)
    gaps = [sync.sync(model, "bf16-base").gap]
    _train(torch, model, seed=1, lr=0.5)
    report = sync.sync(model, "bf16-step-1")
    _timings(request, report)
    gaps.append(report.gap)
    request.node.user_properties.append(("bf16_gaps", gaps))
    sys.__stderr__.write(f"\nbf16 on both sides: probe gaps {gaps} (tolerance {tolerance})\n")
    assert all(gap <= tolerance for gap in gaps), (gaps, tolerance)
    assert sync.weight_version() == "bf16-step-1"
