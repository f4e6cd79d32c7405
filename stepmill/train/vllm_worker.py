"""A vLLM worker extension (``--worker-extension-cls``): reload a new policy's weights in place and keep
tied embeddings tied.

vLLM 0.32's in-place reload (``reload_weights``) loads ``embed_tokens`` but never reprocesses a tied
``lm_head``: the checkpoint holds no ``lm_head.weight``, so the layer keeps the kernel state it was given
at start. On the CPU build that state is a prepacked GEMM handle made from the OLD embedding, so the
engine samples from the old output layer while reading the new input embedding. ``stepmill_reload``
reloads, points ``lm_head`` at the embedding again and rebuilds its kernel state.

The engine's own Python imports this file as a top-level module (stepmill_vllm_worker) from a folder
that holds only it, so it imports nothing of stepmill and torch only where vLLM has already loaded it.
"""

from __future__ import annotations

import shutil
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
