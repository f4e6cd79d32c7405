"""A checkpoint restores what the next step depends on: a policy resumed from it takes the very step
the uninterrupted policy takes (same weights, optimizer moments and random draws after it)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stepmill.train.checkpoint import Resume, checkpoint_folder, latest  # noqa: E402
from stepmill.train.config import TrainConfig  # noqa: E402
from stepmill.train.policy import Policy  # noqa: E402

from .test_train_layouts import REWARDS, layouts, tiny_qwen2  # noqa: E402,F401  (layouts: the fixture)
from .test_trainer_micro_batches import claimed  # noqa: E402


def test_a_resumed_policy_takes_the_uninterrupted_policys_next_step(layouts, tmp_path):
    store, _ = layouts
    tiny_qwen2(seed=0, dtype=torch.float32).save_pretrained(tmp_path / "m")
    train = TrainConfig(model=str(tmp_path / "m"), lr=1e-2).check()
    db = str(tmp_path / "stepmill.db")
    groups = claimed(store)

    running = Policy(train)
    resume = Resume(db, "train", running, resume=False)
    running.step(groups, update=True)
    torch.rand(5)  # the generator moved on since the seed (as sampling or dropout would move it)
    resume.save(1, groups, {"reward": 0.5})
    draw = torch.rand(3)
    running.step(groups, update=True)  # the uninterrupted run's second step
    after = {k: v.clone() for k, v in running.model.state_dict().items()}

    fresh = Policy(train)  # a new process: the starting weights, a new optimizer
    resumed = Resume(db, "train", fresh, resume=True)
    assert (resumed.version, resumed.groups, resumed.metrics, resumed.rounds) == (
        1, list(REWARDS), {"reward": 0.5}, "train-resume1")
    assert torch.equal(torch.rand(3), draw)
    fresh.step(groups, update=True)
    for name, value in fresh.model.state_dict().items():
        torch.testing.assert_close(value, after[name], atol=1e-7, rtol=0, msg=name)

    resumed.finish(2)
    assert latest(checkpoint_folder(db, "train"))["done"]
    assert len(list(checkpoint_folder(db, "train").glob("v*.pt"))) == 2  # the two newest kept
    Resume(db, "train", Policy(train), resume=False)  # a fresh start under the name: no checkpoint is its
    assert latest(checkpoint_folder(db, "train")) is None
