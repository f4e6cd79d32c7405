"""The engine serves each new policy, in place, verified before anyone samples from it.

A version's weights go to a fresh folder (safetensors with the HF config), the engine pauses generation,
reloads them without a restart, and a fixed probe proves them while it is still paused: the engine's
logprobs of the probe's tokens, computed inside its worker by stepmill's worker extension
(``stepmill_probe`` over ``collective_rpc``), must equal the trainer's own under the new weights. Only then
is the proxy's policy version set, the prefix cache reset, the engine's weight version set and generation
resumed. A probe that fails leaves generation paused (SyncError): no call is scheduled on weights that
failed it, and the calls the engine holds stay held until the caller resumes or aborts them.

Two ways for vLLM (VLLMSync): the full weights, or a LoRA adapter (probed in the engine under a private
id, then loaded in place under its served name). SGLang's update_weights_from_disk (SGLangSync) is
written to SGLang's request shapes and has no in-place probe (SGLangSync says how far it goes).

vLLM's admin routes exist only with ``VLLM_SERVER_DEV_MODE=1``; ``stepmill.auth.admin_routes`` lists them
(and SGLang's) so the proxy and a run's door refuse them: only the trainer may call them.

Torch is imported inside the functions that need it: ADMIN_ROUTES and the HTTP side load without it.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# The engine's admin routes (weights, caches, RPC into its workers): one list, which the proxy and a run's
# door refuse to agents; re-exported here for the trainer, the only caller that may use them.
from stepmill.auth.admin_routes import ADMIN_ROUTES, is_admin_route
from stepmill.errors import ConfigError, SyncError


# ---------------------------------------------------------------------------------------------- probe

QWEN2_TOKENS = 151643  # ordinary tokens of the Qwen2 vocabulary; the special ones follow


def probe_tokens(count: int = 256, *, seed: int = 0, vocab_size: int = QWEN2_TOKENS) -> list[int]:
    """The fixed probe: ``count`` token ids drawn with ``seed`` from the first ``vocab_size`` ids."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(count)]


def trainer_logprobs(model: Any, tokens: Sequence[int], lora: "LoraAdapter | None" = None) -> list[float]:
    """The trainer's logprob of each probe token after the first, given the ones before it (a HF causal
    LM, in eval mode for the pass; with ``lora``, its update merged into the weights meanwhile)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), (applied_lora(model, lora) if lora is not None else _nothing()):
            device = next(model.parameters()).device
            ids = torch.tensor([list(tokens)], device=device)
            logits = model(ids).logits[0, :-1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            return picked.tolist()
    finally:
        model.train(was_training)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def is_peft(model: Any) -> bool:
    """A peft model (``peft_config``): its forward applies its adapter."""
    return isinstance(getattr(model, "peft_config", None), dict)


def gap(trainer: Sequence[float], engine: Sequence[float]) -> float:
    """The largest absolute difference between two logprob lists (inf when their lengths differ)."""
    if len(trainer) != len(engine):
        return float("inf")
    return max((abs(a - b) for a, b in zip(trainer, engine)), default=0.0)


# -------------------------------------------------------------------------------------- weight folders

def weights_root(run_dir: Path, need_bytes: int) -> Path:
    """A private folder for the versions' weights: in /dev/shm when it exists and holds two versions
    (the old one stays until the new one is served), else a temporary folder in ``run_dir``."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        try:
            if shutil.disk_usage(shm).free > 2 * need_bytes + (64 << 20):
                return Path(tempfile.mkdtemp(prefix="stepmill-weights-", dir=shm))
        except OSError:
            pass
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="weights-", dir=run_dir))


def model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def version_folder(root: Path, version: str, kind: str = "full") -> Path:
    """``root``/<kind>-<version>; a version is a name, not a path."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", version):
        raise ConfigError(f"a weight version is letters, digits, '.', '_' and '-' (at most 128), not {version!r}")
    return Path(root) / f"{kind}-{version}"


def save_weights(model: Any, folder: Path) -> Path:
    """The model's weights as safetensors with its HF config (what vLLM loads), written beside
    ``folder`` and renamed into place so a reader never sees half a version."""
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def prune(root: Path, keep: Path) -> None:
    """Remove the folders of ``keep``'s kind in ``root`` but ``keep``, once ``keep`` is served. The other
    kind stays: vLLM reads a served adapter's folder again whenever it evicted the adapter from memory."""
    kind = keep.name.split("-", 1)[0] + "-"
    for entry in Path(root).iterdir():
        if entry != keep and entry.is_dir() and entry.name.startswith(kind):
            shutil.rmtree(entry, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- LoRA

@dataclass
class LoraAdapter:
    """A LoRA update: per module path (``model.layers.0.self_attn.q_proj``) the pair (A [r, in],
    B [out, r]); the module's weight becomes W + (alpha / r) · B·A."""

    r: int
    alpha: float
    weights: dict[str, tuple[Any, Any]]

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @property
    def target_modules(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[-1] for name in self.weights})

    @classmethod
    def from_peft(cls, model: Any, adapter: str = "default") -> "LoraAdapter":
        """The adapter a peft model trains (``peft.get_peft_model``), as the base model's module paths
        and the (A, B) pair of each, detached: what ``save_lora`` writes and vLLM loads."""
        from peft.tuners.lora import LoraLayer

        config = model.peft_config[adapter]
        if getattr(config, "use_rslora", False) or getattr(config, "use_dora", False):
            raise ConfigError("a LoRA adapter with rsLoRA or DoRA has no W + (alpha / r)·B·A form to serve")
        weights = {name: (module.lora_A[adapter].weight.detach(), module.lora_B[adapter].weight.detach())
                   for name, module in model.get_base_model().named_modules()
                   if isinstance(module, LoraLayer) and adapter in module.lora_A}
        return cls(r=config.r, alpha=config.lora_alpha, weights=weights)


def save_lora(adapter: LoraAdapter, folder: Path, *, base_model: str = "") -> Path:
    """The adapter in PEFT's format (adapter_config.json, adapter_model.safetensors with
    ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), what vLLM's LoRA loader reads."""
    from safetensors.torch import save_file

    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = {}
    for module, (a, b) in adapter.weights.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().contiguous().cpu()
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": adapter.r, "lora_alpha": adapter.alpha, "target_modules": adapter.target_modules,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "inference_mode": True}
    (partial / "adapter_config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


@contextmanager
def applied_lora(model: Any, adapter: LoraAdapter) -> Iterator[Any]:
    """The model with the adapter merged into its weights for the block, the originals put back after."""
    import torch

    saved = {}
    try:
        with torch.no_grad():
            for module_name, (a, b) in adapter.weights.items():
                weight = model.get_submodule(module_name).weight
                saved[module_name] = weight.detach().clone()
                weight.add_((b.to(weight) @ a.to(weight)) * adapter.scale)
        yield model
    finally:
        with torch.no_grad():
            for module_name, original in saved.items():
                model.get_submodule(module_name).weight.copy_(original)


# --------------------------------------------------------------------------------------------- report

@dataclass
class SyncReport:
    """One sync: the version served, where its weights lie, seconds per phase, the probe's max gap."""

    version: str
    kind: str  # "full" or "lora"
    path: str
    seconds: dict[str, float] = field(default_factory=dict)
    gap: float = float("nan")

    @property
    def paused_seconds(self) -> float:
        """How long generation stood still: from the pause to the resume."""
        return round(sum(self.seconds.get(k, 0.0) for k in PAUSED_PHASES), 4)

    @property
    def total_seconds(self) -> float:
        return round(sum(self.seconds.values()), 4)

    def as_dict(self) -> dict:
        return {"version": self.version, "kind": self.kind, "path": self.path, "gap": self.gap,
                "seconds": dict(self.seconds), "paused_seconds": self.paused_seconds,
                "total_seconds": self.total_seconds}


# The phases during which the engine generates nothing: "save" and the trainer's side of the probe come
# before, "prune" after.
PAUSED_PHASES = ("pause", "reload", "probe_engine", "stamp", "reset_cache", "version", "resume")


class _Phases:
    def __init__(self, report: SyncReport):
        self.report = report

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.report.seconds[name] = round(time.perf_counter() - started, 4)


# ---------------------------------------------------------------------------------------------- HTTP

# The trainer talks to the engine directly, whatever *_PROXY says: stepmill's proxy refuses these routes.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _root(url: str) -> str:
    """The server's root from its root or its OpenAI base URL (…/v1)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class _Engine:
    def __init__(self, url: str, timeout: float, version: str = "?"):
        self.root, self.timeout, self.version = _root(url), timeout, version

    def call(self, method: str, path: str, body: Any = None, *, what: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.root + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with _DIRECT.open(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:2000].decode(errors="replace")
            raise SyncError(f"{what} failed for weight version {self.version}: {method} {path} answered "
                            f"{exc.code}: {detail}", version=self.version) from None
        except OSError as exc:
            raise SyncError(f"{what} failed for weight version {self.version}: {method} {path}: {exc}",
                            version=self.version) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")


@contextmanager
def _left_paused(version: str) -> Iterator[None]:
    """A step between the pause and the resume failed, the probe included: the engine stays paused, and
    nothing is scheduled on weights that were not verified."""
    try:
        yield
    except SyncError as exc:
        raise SyncError(f"{exc}; generation is left paused, nothing sampled from these weights (POST /resume "
                        "would serve them; VLLMSync.abort_held ends the calls it holds)",
                        version=version, gap=exc.gap) from None


# ---------------------------------------------------------------------------------------------- vLLM

class VLLMSync:
    """Serve each new policy on a vLLM server started with VLLM_SERVER_DEV_MODE=1, verified by the probe.

    ``url``: the server's root or its /v1 base URL; ``served_model``: its served model name.
    ``root``: where versions' folders go (weights_root picks one when None, in ``run_dir``'s fallback).
    ``pause_mode``: what vLLM does with calls in flight while the weights change — "wait" (default:
    they finish on the old weights, so every call is wholly one version), "keep" (frozen, finished on
    the new) or "abort". ``reload``: "stepmill" (the worker extension's reload, which re-ties tied
    embeddings; the server needs ``--worker-extension-cls``) or "vllm" (vLLM's own reload_weights,
    which serves a stale lm_head for a tied model: refused for one unless ``allow_stale_tied``).

    /sleep and /wake_up are not used: on the CPU build they do nothing (CPUWorker.sleep is a no-op).
    """

    def __init__(self, url: str, served_model: str, *, root: Path | None = None, run_dir: Path | None = None,
                 probe: Sequence[int] | None = None, tolerance: float = 1e-4, pause_mode: str = "wait",
                 reload: str = "stepmill", allow_stale_tied: bool = False, timeout: float = 300):
        if pause_mode not in ("wait", "keep", "abort"):
            raise ConfigError(f"pause_mode is wait, keep or abort, not {pause_mode!r}")
        if reload not in ("stepmill", "vllm"):
            raise ConfigError(f"reload is stepmill or vllm, not {reload!r}")
        self.url, self.served_model = _root(url), served_model
        self.root = Path(root) if root is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.gettempdir())
        self.probe = list(probe) if probe is not None else probe_tokens()
        self.tolerance, self.pause_mode, self.reload = tolerance, pause_mode, reload
        self.allow_stale_tied, self.timeout = allow_stale_tied, timeout
        self.lora_name: str | None = None  # the adapter name once a LoRA version is served

    def _folders(self, model: Any) -> Path:
        if self.root is None:
            self.root = weights_root(self.run_dir, model_bytes(model))
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    # -- the full weights

    def sync(self, model: Any, version: str, *, while_paused: Callable[[float], None] | None = None) -> SyncReport:
        """Write ``model``'s weights as ``version``, load them while generation is paused, check them by the
        probe inside the engine, and resume only when they pass; SyncError when a step fails or the probe's
        gap exceeds the tolerance (generation is then left paused: no call is scheduled on those weights).
        ``while_paused(paused_at)``: called once the new weights passed the probe and before generation
        resumes, with the time the pause was asked for (epoch seconds): where a trainer sets the proxy's
        policy version from that moment, so every call the engine held is stamped with the weights it gets."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        if tied and self.reload == "vllm" and not self.allow_stale_tied:
            raise ConfigError("vLLM's own reload_weights keeps a tied lm_head's old weights (the probe then "
                              "fails); start the server with stepmill's worker extension and use reload='stepmill'")
        folder = version_folder(self._folders(model), version)
        report = SyncReport(version, "full", str(folder))
        phase, engine = _Phases(report), _Engine(self.url, self.timeout, version)
        with phase("save"):
            save_weights(model, folder)
        with phase("probe_trainer"):  # before the pause: the engine waits for nothing of the trainer's
            expected = trainer_logprobs(model, self.probe)
        paused_at = time.time()
        with phase("pause"):
            engine.call("POST", f"/pause?mode={self.pause_mode}", what="pausing generation")
        with _left_paused(version):
            with phase("reload"):
                method = "stepmill_reload" if self.reload == "stepmill" else "reload_weights"
                engine.call("POST", "/collective_rpc", {"method": method, "kwargs": {"weights_path": str(folder)}},
                            what="reloading the weights")
            with phase("probe_engine"):
                report.gap = gap(expected, engine_probe(engine, self.probe))
            self._check(report)
            self._stamp(phase, version, paused_at, while_paused)
            self._finish(engine, phase, version)
        with phase("prune"):
            prune(self.root, folder)
        return report

    # -- a LoRA adapter

    def sync_lora(self, model: Any, adapter: LoraAdapter, version: str, *, name: str = "policy",
                  while_paused: Callable[[float], None] | None = None) -> SyncReport:
        """Write ``adapter`` as ``version`` and load it in place under ``name`` (the server was started
        with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); calls that name ``name`` as their model
        get it. While generation is paused the engine probes the adapter's folder under a private id no
        request can name, against the trainer's logprobs under the adapter: ``model`` is the base model
        (the adapter is merged into it for the trainer's side) or the peft model that trains ``adapter``
        (its own forward applies it, so the conversion to ``adapter`` is checked too). Only when it passes
        is the folder loaded under ``name``, ``while_paused`` called (as ``sync`` calls it) and generation
        resumed. A failed probe leaves generation paused and ``name`` on its last verified version (SyncError)."""
        folder = version_folder(self._folders(model), version, kind="lora")
        report = SyncReport(version, "lora", str(folder))
        phase, engine = _Phases(report), _Engine(self.url, self.timeout, version)
        with phase("save"):
            save_lora(adapter, folder, base_model=self.served_model)
        with phase("probe_trainer"):
            expected = trainer_logprobs(model, self.probe, lora=None if is_peft(model) else adapter)
        paused_at = time.time()
        with phase("pause"):
            engine.call("POST", f"/pause?mode={self.pause_mode}", what="pausing generation")
        with _left_paused(version):
            with phase("probe_engine"):
                report.gap = gap(expected, engine_probe(engine, self.probe, lora_path=folder))
            self._check(report)
            with phase("reload"):  # the folder just verified, read again under the served name
                # in place whether or not the name is loaded: a resumed trainer's name may be, from before
                engine.call("POST", "/v1/load_lora_adapter",
                            {"lora_name": name, "lora_path": str(folder), "load_inplace": True},
                            what="loading the LoRA adapter")
                self.lora_name = name
            self._stamp(phase, version, paused_at, while_paused)
            self._finish(engine, phase, version)
        with phase("prune"):
            prune(self.root, folder)
        return report

    # -- shared steps

    @staticmethod
    def _stamp(phase: _Phases, version: str, paused_at: float, while_paused: Callable[[float], None] | None) -> None:
        if while_paused is None:
            return
        with phase("stamp"):
            try:
                while_paused(paused_at)
            except Exception as exc:  # the proxy's version not set: serve nothing it would mis-stamp
                raise SyncError(f"setting the policy version for {version!r} failed: {exc}", version=version) from exc

    def _finish(self, engine: _Engine, phase: _Phases, version: str) -> None:
        with phase("reset_cache"):
            # KV blocks computed with the old weights must not be reused; running calls hold none while paused
            answer = engine.call("POST", "/reset_prefix_cache", what="resetting the prefix cache")
            if isinstance(answer, dict) and answer.get("success") is False:
                raise SyncError(f"the engine kept its prefix cache for weight version {version} (blocks still "
                                "held)", version=version)
        with phase("version"):
            engine.call("POST", "/update_weight_version", {"new_version": version}, what="setting the weight version")
        with phase("resume"):
            engine.call("POST", "/resume", what="resuming generation")

    def _check(self, report: SyncReport) -> None:
        if not report.gap <= self.tolerance:
            raise SyncError(f"weight version {report.version} is not what the engine holds: the probe's logprobs "
                            f"differ from the trainer's by up to {report.gap:.3g} (tolerance {self.tolerance:g})",
                            version=report.version, gap=report.gap)

    def verify(self, model: Any, version: str, *, lora: LoraAdapter | None = None) -> float:
        """The probe alone, over HTTP on a serving engine (what it serves now, by the route agents use): the
        max gap between ``model``'s logprobs (with ``lora`` merged, then against the adapter's served name)
        and the engine's; beyond the tolerance the engine is paused (held calls stay held) and SyncError
        says so."""
        report = SyncReport(version, "lora" if lora is not None else "full", "")
        expected = trainer_logprobs(model, self.probe, lora=lora)
        served = self.lora_name if lora is not None and self.lora_name else self.served_model
        report.gap = gap(expected, vllm_logprobs(self.url, served, self.probe, timeout=self.timeout))
        try:
            self._check(report)
        except SyncError as exc:
            _Engine(self.url, self.timeout, version).call("POST", "/pause?mode=keep",
                                                          what="pausing the engine after a failed verification")
            raise SyncError(f"{exc}; the engine is paused (POST /resume to serve anyway)",
                            version=version, gap=report.gap) from None
        return report.gap

    def engine_logprobs(self, *, lora_path: Path | None = None) -> list[float]:
        """The probe's logprobs as the engine computes them in place (what sync checks while paused)."""
        return engine_probe(_Engine(self.url, self.timeout), self.probe, lora_path=lora_path)

    def weight_version(self) -> str | None:
        """The weight version the engine reports (GET /weight_info)."""
        answer = _Engine(self.url, self.timeout).call("GET", "/weight_info", what="reading the weight version")
        return answer.get("weight_version") if isinstance(answer, dict) else None

    def is_paused(self) -> bool:
        answer = _Engine(self.url, self.timeout).call("GET", "/is_paused", what="reading the pause state")
        return bool(isinstance(answer, dict) and answer.get("is_paused"))

    def resume(self) -> None:
        _Engine(self.url, self.timeout).call("POST", "/resume", what="resuming generation")

    def abort_held(self) -> None:
        """After a failed sync: end every call the paused engine holds (their clients get vLLM's abort),
        generation still paused; what a trainer that stops does, so its rollouts end now rather than at
        their timeout."""
        _Engine(self.url, self.timeout).call("POST", "/pause?mode=abort", what="aborting the calls it holds")

    def close(self) -> None:
        """Remove every version's folder (the engine keeps the full weights it loaded in memory). A LoRA
        adapter this sync served is unloaded first: vLLM reads a served adapter's folder again whenever it
        evicted the adapter from memory, and a folder gone then kills its engine (EngineDeadError, seen on
        its CPU build), so after the run the name is not served; the last adapter is in the trainer's
        last checkpoint."""
        if self.lora_name is not None:
            try:
                _Engine(self.url, self.timeout).call("POST", "/v1/unload_lora_adapter", {"lora_name": self.lora_name},
                                                     what="unloading the LoRA adapter")
            except SyncError:  # an engine already gone or restarted serves no adapter of this run
                pass
            self.lora_name = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def engine_probe(engine: _Engine, tokens: Sequence[int], *, lora_path: Path | None = None) -> list[float]:
    """The probe's logprobs computed inside the engine by stepmill's worker extension (``stepmill_probe``):
    no request is scheduled, so it answers while generation is paused; one list per worker, all equal.
    With ``lora_path``: under the adapter in that folder, loaded for the probe alone."""
    kwargs = {"tokens": json.dumps(list(tokens))}
    if lora_path is not None:
        kwargs["lora_path"] = str(lora_path)
    answer = engine.call("POST", "/collective_rpc", {"method": "stepmill_probe", "kwargs": kwargs},
                         what="reading the probe's logprobs in the engine")
    try:
        rows = [[float(x) for x in result["logprobs"]] for result in answer["results"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise SyncError(f"the engine's workers gave no probe logprobs ({exc!r}: is the server started with "
                        f"stepmill's worker extension?): {str(answer)[:500]}") from None
    if not rows or any(row != rows[0] for row in rows):
        raise SyncError(f"the engine's {len(rows)} workers disagree on the probe (or none answered)")
    return rows[0]


def vllm_logprobs(url: str, served_model: str, tokens: Sequence[int], *, timeout: float = 120) -> list[float]:
    """vLLM's logprob of each token after the first given the ones before (/v1/completions with the
    token ids as the prompt, one sampled token, ``prompt_logprobs``)."""
    body = {"model": served_model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0}
    answer = _Engine(url, timeout).call("POST", "/v1/completions", body, what="reading the probe's logprobs")
    try:
        rows = answer["choices"][0]["prompt_logprobs"]
        return [float(rows[i][str(token)]["logprob"]) for i, token in enumerate(tokens) if i > 0]
    except (KeyError, IndexError, TypeError) as exc:
        raise SyncError(f"the engine's answer holds no prompt logprobs for the probe ({exc!r}): "
                        f"{str(answer)[:500]}") from None


# -------------------------------------------------------------------------------------------- SGLang

class SGLangSync:
    """The same contract on an SGLang server (``python -m sglang.launch_server``), by its own routes:
    POST /pause_generation {"mode"}, POST /update_weights_from_disk {"model_path", "load_format",
    "flush_cache", "abort_all_requests", "weight_version"} (the reload, the cache flush and the weight
    version in one call), POST /continue_generation, and the probe through POST /generate with
    ``return_logprob`` and ``logprob_start_len`` 0 (meta_info.input_token_logprobs: [logprob, id, text]).

    Unlike VLLMSync, the probe runs AFTER /continue_generation: stepmill has no extension inside SGLang's
    workers to run it in place, and /generate is not scheduled while generation is paused, so calls in
    the window between the resume and the probe's answer get weights not yet verified. A failed probe
    pauses generation again (retract) and raises: what the engine served in that window is the caller's
    to discard (the loop uses VLLMSync). Not run here: SGLang does not install on this CPU-only machine,
    so nothing tests it against a real server yet."""

    def __init__(self, url: str, *, root: Path | None = None, run_dir: Path | None = None,
                 probe: Sequence[int] | None = None, tolerance: float = 1e-4, pause_mode: str = "retract",
                 timeout: float = 300):
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"SGLang's pause mode is abort, retract or in_place, not {pause_mode!r}")
        self.url = _root(url)
        self.root = Path(root) if root is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.gettempdir())
        self.probe = list(probe) if probe is not None else probe_tokens()
        self.tolerance, self.pause_mode, self.timeout = tolerance, pause_mode, timeout

    def sync(self, model: Any, version: str) -> SyncReport:
        if self.root is None:
            self.root = weights_root(self.run_dir, model_bytes(model))
        folder = version_folder(self.root, version)
        report = SyncReport(version, "full", str(folder))
        phase, engine = _Phases(report), _Engine(self.url, self.timeout, version)
        with phase("save"):
            save_weights(model, folder)
        with phase("probe_trainer"):  # before the pause, so that the engine's answer is all that follows the resume
            expected = trainer_logprobs(model, self.probe)
        with phase("pause"):
            engine.call("POST", "/pause_generation", {"mode": self.pause_mode}, what="pausing generation")
        with phase("reload"):
            answer = engine.call("POST", "/update_weights_from_disk",
                                 {"model_path": str(folder), "load_format": None, "flush_cache": True,
                                  "abort_all_requests": False, "weight_version": version},
                                 what="reloading the weights")
            if not (isinstance(answer, dict) and answer.get("success")):
                raise SyncError(f"SGLang did not load weight version {version}: {answer}", version=version)
        with phase("resume"):
            engine.call("POST", "/continue_generation", {}, what="resuming generation")
        with phase("probe_engine"):
            report.gap = gap(expected, sglang_logprobs(self.url, self.probe))
        if not report.gap <= self.tolerance:
            engine.call("POST", "/pause_generation", {"mode": "retract"}, what="pausing after a failed verification")
            raise SyncError(f"weight version {version} is not what SGLang serves: the probe's logprobs differ "
                            f"from the trainer's by up to {report.gap:.3g} (tolerance {self.tolerance:g}); "
                            "generation is paused again, after serving them since the resume",
                            version=version, gap=report.gap)
        with phase("prune"):
            prune(self.root, folder)
        return report

    def weight_version(self) -> str | None:
        answer = _Engine(self.url, self.timeout).call("GET", "/get_weight_version", what="reading the weight version")
        return answer.get("weight_version") if isinstance(answer, dict) else None


def sglang_logprobs(url: str, tokens: Sequence[int], *, timeout: float = 120) -> list[float]:
    body = {"input_ids": list(tokens), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}
    answer = _Engine(url, timeout).call("POST", "/generate", body, what="reading the probe's logprobs")
    try:
        rows = answer["meta_info"]["input_token_logprobs"]
        return [float(row[0]) for row in rows[1:len(tokens)]]
    except (KeyError, IndexError, TypeError) as exc:
        raise SyncError(f"SGLang's answer holds no input logprobs for the probe ({exc!r}): "
                        f"{str(answer)[:500]}") from None


__all__ = ["ADMIN_ROUTES", "is_admin_route", "probe_tokens", "trainer_logprobs", "gap", "weights_root",
           "model_bytes", "version_folder", "save_weights", "prune", "LoraAdapter", "save_lora", "applied_lora", "is_peft",
           "SyncReport", "PAUSED_PHASES", "VLLMSync", "engine_probe", "vllm_logprobs", "SGLangSync", "sglang_logprobs"]
