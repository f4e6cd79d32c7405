"""From step records to what trainers consume: token ids with provenance, checks, tensors, exports."""

# From the repository root the folder is importable as `trainer_bridge` too, which would load a
# second copy of every module (with classes that differ from stepmill's).
if __name__ != "stepmill.trainer_bridge":
    raise ImportError("import stepmill.trainer_bridge, not trainer_bridge: this folder is installed as the "
                      "package stepmill.trainer_bridge (pip install -e .)")

from stepmill.trainer_bridge.layouts import Batch, step_batches, trajectory_batch, trajectory_rows, tree_batch
from stepmill.trainer_bridge.prefix_tree import PackedTree, dense_tree_mask, flex_mask_mod, pack_tree
from stepmill.trainer_bridge.render import Rendered, Renderer, load_tokenizer
from stepmill.trainer_bridge.tokenize_steps import TokenizeReport, tokenize_steps

__all__ = ["Batch", "step_batches", "trajectory_batch", "trajectory_rows", "tree_batch", "PackedTree",
           "dense_tree_mask", "flex_mask_mod", "pack_tree", "Rendered", "Renderer", "load_tokenizer",
           "TokenizeReport", "tokenize_steps"]
