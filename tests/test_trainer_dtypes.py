"""bfloat16 on the CPU: the trainer loads the weights in bf16, its loss and gradients on the groups
follow float32's within bf16's rounding, and its optimizer step moves the weights (finite)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stepmill.train.config import TrainConfig  # noqa: E402
from stepmill.train.policy import Policy  # noqa: E402

from .test_train_layouts import layouts, tiny_qwen2  # noqa: E402,F401  (layouts: the fixture)
from .test_trainer_micro_batches import claimed  # noqa: E402


@pytest.mark.parametrize("layout", ["steps", "tree"])
def test_bf16_on_the_cpu_trains_close_to_float32(layouts, tmp_path, layout):
    store, _ = layouts
    tiny_qwen2(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "m")
    stats, moved = {}, {}
    for dtype in ("float32", "bfloat16"):
        policy = Policy(TrainConfig(model=str(tmp_path / "m"), layout=layout, dtype=dtype, lr=1e-2,
                                    micro_batch_tokens=200).check())
        assert next(policy.model.parameters()).dtype == getattr(torch, dtype)
        before = {n: p.detach().float().clone() for n, p in policy.model.named_parameters()}
        stats[dtype] = policy.step(claimed(store), update=True)
        moved[dtype] = max(float((p.detach().float() - before[n]).abs().max())
                           for n, p in policy.model.named_parameters())
        assert all(torch.isfinite(p).all() for p in policy.model.parameters())
    assert stats["bfloat16"]["micro_batches"] > 1 and "skipped_steps" not in stats["bfloat16"]
    assert moved["bfloat16"] > 1e-3  # lr 1e-2 with Adam: a step moves each weight by about the lr
    assert stats["bfloat16"]["loss"] == pytest.approx(stats["float32"]["loss"], abs=2e-2)
    assert stats["bfloat16"]["grad_norm"] == pytest.approx(stats["float32"]["grad_norm"], rel=0.1)
