"""A vLLM worker extension (``--worker-extension-cls``): reload a new policy's weights in place, keep
tied embeddings tied, and read the probe's logprobs from the loaded model while generation is paused.

vLLM 0.32's in-place reload (``reload_weights``) loads ``embed_tokens`` but never reprocesses a tied
``lm_head``: the checkpoint holds no ``lm_head.weight``, so the layer keeps the kernel state it was given
at start. On the CPU build that state is a prepacked GEMM handle made from the OLD embedding, so the
engine samples from the old output layer while reading the new input embedding. ``stepmill_reload``
reloads, points ``lm_head`` at the embedding again and rebuilds its kernel state.

``stepmill_probe`` is how a new version is checked before anyone samples from it: a forward pass of the
loaded model on the probe's tokens inside the worker, while the scheduler is paused (no request can be
scheduled then, so none sees weights that fail it). Every weight goes through the engine's own layers and
kernels (embedding, projections, norms, rotary, the output layer's prepacked GEMM); only the attention
of that one sequence is computed by torch's causal SDPA instead of the paged-cache kernel, so the probe
writes nothing into the KV cache that held calls own.

The engine's own Python imports this file as a top-level module (stepmill_vllm_worker) from a folder
that holds only it, so it imports nothing of stepmill and torch only where vLLM has already loaded it.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

MODULE = "stepmill_vllm_worker"
CLASS = "StepmillWorkerExtension"


def install(folder: Path) -> tuple[Path, str]:
    """Copy this file into ``folder`` as the only module there; returns the folder for the engine's
    PYTHONPATH and the ``--worker-extension-cls`` qualified name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, folder / f"{MODULE}.py")
    return folder, f"{MODULE}.{CLASS}"


class StepmillWorkerExtension:
    """Mixed into vLLM's worker class; each method is a ``collective_rpc`` name (prefixed so none clashes
    with the worker's own attributes). Arguments arrive as strings: the dev-mode route passes only those."""

    def stepmill_reload(self, weights_path: str, retie: str = "1") -> dict:
        """Reload the weights from ``weights_path`` in place; with ``retie`` ("1"), re-tie lm_head."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        retied = False
        if tied and retie == "1":
            retied = _retie(model)
        return {"tied": tied, "retied": retied, "weights_path": weights_path}

    def stepmill_tied(self) -> dict:
        """Whether the served model ties lm_head to embed_tokens, and whether they share storage now."""
        model = self.model_runner.get_model()
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        head, embed = _head_and_embed(model)
        shared = head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr()
        return {"tied": tied, "shared": shared}


    def stepmill_probe(self, tokens: str, lora_path: str = "") -> dict:
        """The loaded model's logprob of each token after the first given the ones before (``tokens``: a
        JSON list of ids), what vLLM's ``prompt_logprobs`` gives for them, computed in place; with
        ``lora_path``, under the adapter in that folder (loaded for the probe alone, then removed)."""
        import torch
        from vllm.forward_context import set_forward_context

        ids = json.loads(tokens)
        if not (isinstance(ids, list) and len(ids) > 1 and all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ValueError("the probe is a JSON list of at least two token ids")
        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        positions = torch.arange(len(ids), dtype=torch.long, device=device)
        # skip_compiled: the eager modules; slot_mapping {}: no layer writes the KV cache
        with torch.inference_mode(), _adapter_for_probe(self.model_runner, lora_path, len(ids)), \
                _causal_sdpa(model), set_forward_context(None, self.vllm_config, num_tokens=len(ids),
                                                         slot_mapping={}, skip_compiled=True):
            hidden = model(input_ids=input_ids, positions=positions)
            logits = model.compute_logits(hidden)
        picked = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, input_ids[1:, None])[:, 0]
        return {"logprobs": picked.tolist()}


# An adapter id the server's own counter (1, 2, … per adapter loaded) never reaches: no request names it.
PROBE_LORA_ID = 1 << 30


@contextmanager
def _adapter_for_probe(runner, lora_path: str, count: int):
    """The probe's tokens mapped to the adapter in ``lora_path`` (under PROBE_LORA_ID, removed after) or,
    without one, to the base model; on a server without --enable-lora there is nothing to map. The next
    scheduled step sets its own mapping (and activates its own adapters) again."""
    if not getattr(runner, "lora_config", None):
        if lora_path:
            raise RuntimeError("the server serves no LoRA adapters (start it with --enable-lora)")
        yield
        return
    if not lora_path:
        runner._set_active_loras((0,) * count, (0,) * count, set())
        yield
        return
    from vllm.lora.request import LoRARequest

    request = LoRARequest(lora_name="stepmill-probe", lora_int_id=PROBE_LORA_ID, lora_path=lora_path)
    runner.remove_lora(PROBE_LORA_ID)  # one an interrupted probe left
    try:
        runner._set_active_loras((PROBE_LORA_ID,) * count, (PROBE_LORA_ID,) * count, {request})
        yield
    finally:
        runner.remove_lora(PROBE_LORA_ID)


class _CausalAttention:
    """Stands in for a layer's attention backend during the probe: one sequence, causal, grouped-query,
    the layer's own scale; the KV cache is neither read nor written."""

    def __init__(self, impl):
        self.impl = impl

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                output_block_scale=None):
        import torch.nn.functional as F

        heads, kv_heads = query.shape[1], key.shape[1]
        # [1, heads, tokens, head_size], contiguous: the layout a HF trainer's SDPA runs on
        query, key, value = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (query, key, value))
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.impl.scale,
                                                  enable_gqa=heads != kv_heads)
        output[: attended.shape[2]].copy_(attended[0].transpose(0, 1))
        return output


def _plain_causal(impl) -> bool:
    """Attention the SDPA stand-in computes exactly: a decoder's, no window, no ALiBi, no soft cap, no sinks."""
    return (getattr(impl, "attn_type", "decoder") == "decoder"
            and getattr(impl, "sliding_window", None) in (None, -1) and getattr(impl, "alibi_slopes", None) is None
            and not getattr(impl, "logits_soft_cap", 0) and getattr(impl, "sinks", None) is None)


@contextmanager
def _causal_sdpa(model):
    """Every attention layer of ``model`` computed by _CausalAttention for the block, its backend put back after."""
    layers = [m for m in model.modules() if hasattr(m, "impl") and hasattr(m, "layer_name")]
    if not layers:
        raise RuntimeError("the served model has no attention layer the probe knows")
    for layer in layers:
        if not _plain_causal(layer.impl):
            raise RuntimeError(f"{layer.layer_name}: the in-place probe computes plain causal attention only")
    saved = [(layer, layer.impl) for layer in layers]
    try:
        for layer, impl in saved:
            layer.impl = _CausalAttention(impl)
        yield model
    finally:
        for layer, impl in saved:
            layer.impl = impl


def _head_and_embed(model):
    """The output layer and the input embedding under any LoRA wrapper (``base_layer``)."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    head = getattr(head, "base_layer", head)
    embed = getattr(embed, "base_layer", embed)
    if head is None or embed is None or not hasattr(head, "weight") or not hasattr(embed, "weight"):
        return None, None
    return head, embed


def _retie(model) -> bool:
    """Share the embedding's parameter with lm_head and rebuild lm_head's kernel state from it."""
    head, embed = _head_and_embed(model)
    if head is None:
        return False
    if head.weight is not embed.weight:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)  # the CPU build prepacks the GEMM weight here
    return True
