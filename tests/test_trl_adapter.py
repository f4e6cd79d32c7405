"""TRL's GRPOTrainer trained on stepmill's rollouts (stepmill.train.trl_adapter), on the CPU against the
real vLLM (dev mode, stepmill's worker extension): the rollout function serves the trainer's weights on
the engine before each round, the runs go through stepmill, TRL trains on the engine's exact ids and
stepmill's rewards; and on the same sampling seeds its first rounds' rewards are stepmill train's
(round 0 exactly; later rounds as long as no draw falls on a near tie, see the test).

The model is the random Qwen2 the engine serves; the reward (``ascii_letters``, the share of ASCII
letters in the reply) is one a few steps can move. The white-box agent (``one_reply``) asks for one
reply; with ``SAMPLE_SEED=trajectory`` it passes vLLM a per-request seed made from its run's round,
task and sample (never the trainer's name), so two trainers' runs of the same round draw alike.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

TASKS = ["Name a sea animal.", "Say hello to a friend.", "Describe the sky today.", "List three fruits."]
G = 4  # rollouts per task: one GRPO group
MAX_TOKENS = 16
ITERATIONS = 3
LR = 1e-3
SEED = 0
TOLERANCE = 1e-4


# -- what the runs use: the agent and the reward (importable by the runner and the agent's process) ----

def sample_seed(trajectory: str) -> int:
    """The run's seed from ``<run>-r<round>-<dataset>-<task>-<sample>``, the run's name left out."""
    found = re.search(r"-r(\d+)-(.+)$", trajectory)
    key = f"{found.group(1)}:{found.group(2)}" if found else trajectory
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def one_reply(task, session):
    """One reply to the task in Qwen's chat format (temperature 1, seeded when SAMPLE_SEED says so)."""
    ids = session.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    sampling = {"temperature": 1.0}
    if os.environ.get("SAMPLE_SEED") == "trajectory":
        sampling["seed"] = sample_seed(os.environ["STEPMILL_TRAJECTORY"])
    return session.generate(ids, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": task["prompt"]}],
                             **sampling).text


def ascii_letters(trajectory: dict) -> float:
    """The share of the reply's characters that are ASCII letters (0 for an empty reply)."""
    text = (trajectory.get("completion") or {}).get("content") or ""
    text = text if isinstance(text, str) else json.dumps(text)
    return sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0


def write_config(folder: Path, engine, *, seeded: bool) -> Path:
    from .conftest import TESTS

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tasks.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "prompt": p}) + "\n"
                                                for i, p in enumerate(TASKS)))
    env = {"PYTHONPATH": str(TESTS.parent), **({"SAMPLE_SEED": "trajectory"} if seeded else {})}
    config = folder / "rollout.toml"
    config.write_text(f"""[proxy]
confdir = "{folder / 'mitm'}"

[route]
base_url = "{engine.url}"

[[agent]]
name = "one-reply"
entry = "tests.test_trl_adapter:one_reply"
env = {{ {", ".join(f'{k} = "{v}"' for k, v in env.items())} }}

[[dataset]]
name = "words"
path = "tasks.jsonl"

[run]
agent = "one-reply"
dataset = "words"
n = {G}
concurrency = 4
timeout = 120
model = "{engine.name}"

[[reward]]
name = "ascii"
function = "tests.test_trl_adapter:ascii_letters"
""")
    return config


# -- the engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory, request):
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL: known here
    from stepmill.demo.main import ENGINE_INSTALL, start_vllm, vllm_python
    from stepmill.qwen_vocab import default_folder

    from .real_engine import missing

    reuse = os.environ.get("STEPMILL_TEST_SYNC_VLLM")  # port:model_dir:name of such a server already up (a dev loop only)
    if reuse:
        from types import SimpleNamespace

        port, model_dir, name = reuse.split(":", 2)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}/v1", name=name, model_dir=Path(model_dir))
        return
    python = vllm_python()
    if python is None:
        missing(f"vLLM is not installed: run {ENGINE_INSTALL} (it makes .engines/vllm)")
    try:
        server = start_vllm(tmp_path_factory.mktemp("engine"), tokenizer=default_folder(), python=python,
                            timeout=900, tied=True, dev_mode=True, worker_extension=True)
    except RuntimeError as exc:
        pytest.fail(f"the real vLLM did not start: {exc}", pytrace=False)
    yield server
    failed = request.session.testsfailed
    server.stop()
    if failed:
        import sys

        sys.__stderr__.write(f"\n--- the real vLLM's log ({server.log}), last lines:\n{server.log_tail()}\n")


# -- the two trainers -----------------------------------------------------------------------------------

def train_config(engine, iterations: int = ITERATIONS):
    """The ``[train]`` settings both trainers get: the engine's starting weights, GRPO, the same lr and seed."""
    from stepmill.train.config import TrainConfig

    return TrainConfig(model=str(engine.model_dir), method="grpo", layout="steps", iterations=iterations, lr=LR,
                       clip_low=0.2, clip_high=0.28, kl=0.0, tolerance=TOLERANCE, control=False, seed=SEED).check()


def train_with_trl(engine, folder: Path, *, seeded: bool = True, steps: int = ITERATIONS) -> dict:
    """TRL's GRPOTrainer for ``steps`` optimizer steps, each on one round of every task (G rollouts each)."""
    import torch

    from stepmill.runner.config import load
    from stepmill.train.policy import load_model
    from stepmill.train.trl_adapter import trl_train

    config = load(write_config(folder, engine, seeded=seeded))
    db = str(folder / "trl.db")
    seen: list[tuple[list, dict]] = []  # what TRL handed the rollout function and got back
    outcome = trl_train(config, train_config(engine, steps), db=db, name="trl", record=seen, use_cpu=True)
    start = dict(load_model(str(engine.model_dir), SEED).named_parameters())
    moved = max(float((p.detach() - start[name].detach()).abs().max())
                for name, p in outcome.trainer.model.named_parameters())
    return {"rounds": outcome.rounds, "seen": seen, "db": db, "trainer": outcome.trainer, "moved": moved,
            "logged": [e for e in outcome.trainer.state.log_history if "reward" in e], "torch": torch}


def train_with_stepmill(engine, folder: Path, *, seeded: bool = True, iterations: int = ITERATIONS):
    from stepmill.runner.config import load
    from stepmill.train.loop import train_loop

    config = load(write_config(folder, engine, seeded=seeded))
    return train_loop(config, train_config(engine, iterations), db=str(folder / "stepmill.db"), progress=False,
                      name="train").run


@pytest.fixture(scope="module")
def trl_run(engine, tmp_path_factory):
    return train_with_trl(engine, tmp_path_factory.mktemp("trl"))


# -- the tests ------------------------------------------------------------------------------------------

@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_trl_trains_on_stepmill_rollouts(trl_run, engine):
    from stepmill.store import Store
    from stepmill.train.policy import load_model

    torch = trl_run["torch"]
    rounds, seen, trainer = trl_run["rounds"], trl_run["seen"], trl_run["trainer"]
    assert trainer.state.global_step == ITERATIONS and trl_run["moved"] > 0
    # One round per optimizer step, each served as the version of the weights it was sampled from, verified.
    assert [r.version for r in rounds] == list(range(ITERATIONS))
    assert all(r.sync_gap is not None and r.sync_gap <= TOLERANCE for r in rounds)
    store = Store(trl_run["db"], readonly=True)
    for (prompts, output), round_ in zip(seen, rounds):
        # TRL's order: G rows a prompt; each row is a run of that prompt's task, in its group.
        assert len(prompts) == len(TASKS) * G == len(output["completion_ids"])
        for row, (prompt, trajectory) in enumerate(zip(prompts, output["trajectory_id"])):
            task = TASKS.index(prompt)
            assert trajectory.startswith(f"trl-r{round_.number}-words-t{task}-")
            [step] = store.iter_steps(trajectory_id=trajectory)
            # the engine's ids and logprobs as the store keeps them, stamped with the round's version
            assert step["token_provenance"] == "exact"
            assert step["prompt_ids"] == output["prompt_ids"][row]
            assert step["response_ids"] == output["completion_ids"][row]
            assert step["logprobs"] == pytest.approx(output["logprobs"][row], abs=1e-6)
            assert step["policy_version"] == str(round_.version)
        assert output["stepmill_reward"] == round_.rewards and None not in round_.rewards
    # The engine sampled those ids from the starting weights: round 0's logprobs are the trainer's own on them.
    start = load_model(str(engine.model_dir), SEED).eval()
    _, first = seen[0]
    with torch.no_grad():
        for prompt_ids, completion_ids, logprobs in zip(first["prompt_ids"], first["completion_ids"], first["logprobs"]):
            ids = torch.tensor([prompt_ids + completion_ids])
            picked = torch.log_softmax(start(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert picked[len(prompt_ids) - 1:].tolist() == pytest.approx(logprobs, abs=1e-3)
    # TRL's logged reward per step is the mean of stepmill's rewards of that round.
    assert [e["reward"] for e in trl_run["logged"]] == pytest.approx([r.mean_reward for r in rounds], abs=1e-5)
    # Every group was consumed once.
    groups = {g for r in rounds for g in r.group_ids}
    acked = {row["group_id"] for row in store.consumption_staleness() if row["status"] == "acked"}
    assert groups <= acked


def runs_of_trainer(db: str, run: str) -> dict:
    """Each run's step by ``r<round>-<dataset>-<task>-<sample>`` (its id less the trainer's name)."""
    from stepmill.store import Store

    store = Store(db, readonly=True)
    return {s["trajectory_id"][len(run) + 1:]: s for s in store.iter_steps() if s["trajectory_id"].startswith(f"{run}-")}


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_on_the_same_seeds_its_first_rounds_rewards_are_stepmill_trains(trl_run, engine, tmp_path):
    """Round 0 (the same starting weights, the same seeds): the same replies and rewards, exactly. After a
    step the two trainers' weights are close but not equal (TRL adds 1e-4 to the group's std, stepmill
    1e-6; TRL's ratio is to its own logprobs, stepmill's to the engine's), so a later round's replies
    are the same unless a draw falls on a near tie; each version's mean reward is compared."""
    reports = train_with_stepmill(engine, tmp_path)
    stepmill = {r.version: r.metrics["reward"] for r in reports}
    trl = {r.version: r.mean_reward for r in trl_run["rounds"]}
    ours, theirs = runs_of_trainer(trl_run["db"], "trl"), runs_of_trainer(str(tmp_path / "stepmill.db"), "train")
    for version in range(ITERATIONS):
        keys = sorted(k for k in ours if k.startswith(f"r{version}-"))
        assert keys == sorted(k for k in theirs if k.startswith(f"r{version}-")) and len(keys) == len(TASKS) * G
        same = [k for k in keys if ours[k]["response_ids"] == theirs[k]["response_ids"]]
        gap = max(abs(a - b) for k in same for a, b in zip(ours[k]["logprobs"], theirs[k]["logprobs"]))
        print(f"version {version}: mean reward stepmill train {stepmill[version]:.9f}, TRL {trl[version]:.9f}; "
              f"{len(same)}/{len(keys)} replies the same, the engine's logprobs of them apart by up to {gap:.3g}")
        assert [ours[k]["reward"] for k in same] == [theirs[k]["reward"] for k in same]
        if version == 0:
            assert len(same) == len(keys) and gap == 0.0
        assert len(same) >= len(keys) * 3 // 4
        # the same replies: the same mean (stepmill train's batches carry rewards as float32)
        assert trl[version] == pytest.approx(stepmill[version], abs=1e-6 if len(same) == len(keys) else 0.05)


# -- without an engine: TRL's batch as groups, a trajectory row as TRL's completion ----------------------

@settings(deadline=None)  # the first example imports the adapter
@given(st.lists(st.text(max_size=12), min_size=1, max_size=6, unique=True), st.integers(1, 5))
def test_trls_repeated_prompts_are_its_groups(prompts, size):
    from stepmill.train.trl_adapter import runs_of

    batch = [p for p in prompts for _ in range(size)]  # TRL's sampler: each prompt G times in a row
    assert runs_of(batch, size) == prompts


@settings(deadline=None)
@given(st.lists(st.text(max_size=12), min_size=2, max_size=6, unique=True), st.integers(2, 5), st.data())
def test_a_batch_whose_runs_break_is_refused(prompts, size, data):
    from stepmill.errors import ConfigError
    from stepmill.train.trl_adapter import runs_of

    batch = [p for p in prompts for _ in range(size)]
    i = data.draw(st.integers(0, len(batch) - 1))
    batch[i] = prompts[(prompts.index(batch[i]) + 1) % len(prompts)]  # one row of another prompt
    with pytest.raises(ConfigError):
        runs_of(batch, size)
    with pytest.raises(ConfigError):
        runs_of(batch[:-1], size)  # not a whole number of groups


def test_a_multi_turn_row_is_one_completion_its_context_masked():
    import numpy as np

    from stepmill.train.trl_adapter import completion_of
    from stepmill.trainer_bridge.layouts import Row

    # prompt 1 2 3, the model's 4 5, a tool result 6 7, the model's 8
    row = Row("r-t0-0", "r-t0", ["s0", "s1"], ids=np.array([1, 2, 3, 4, 5, 6, 7, 8]),
              loss=np.array([0, 0, 0, 1, 1, 0, 0, 1], np.int8),
              logprobs=np.array([0, 0, 0, -0.5, -0.25, 0, 0, -1], np.float32), reward=0.75)
    done = completion_of(row)
    assert done["prompt_ids"] == [1, 2, 3] and done["completion_ids"] == [4, 5, 6, 7, 8]
    assert done["mask"] == [1, 1, 0, 0, 1] and done["logprobs"] == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert done["reward"] == 0.75 and done["trajectory_id"] == "r-t0-0"


def test_the_reward_function_hands_back_stepmills_rewards():
    from stepmill.errors import ConfigError
    from stepmill.train.trl_adapter import stepmill_reward

    assert stepmill_reward(["p", "p"], ["a", "b"], stepmill_reward=[0.5, None], task_id=["t", "t"]) == [0.5, None]
    with pytest.raises(ConfigError):
        stepmill_reward(["p"], ["a"])


@pytest.mark.torch
def test_trl_gets_stepmill_trains_settings():
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    from stepmill.errors import ConfigError
    from stepmill.train.config import TrainConfig
    from stepmill.train.trl_adapter import grpo_args

    train = TrainConfig(model="m", lr=3e-4, clip_low=0.1, clip_high=0.3, kl=0.01, iterations=7, seed=5).check()
    args = grpo_args(train, prompts=3, group_size=4, output_dir="unused", use_cpu=True)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation,
            args.num_iterations, args.num_generations, args.generation_batch_size) == (12, 1, 1, 1, 4, 12)
    assert (args.learning_rate, args.epsilon, args.epsilon_high, args.beta, args.max_steps, args.seed) == (
        3e-4, 0.1, 0.3, 0.01, 7, 5)
    assert (args.loss_type, args.scale_rewards, args.max_grad_norm, args.weight_decay, args.bf16) == (
        "dapo", "group", 1.0, 0.0, False)
    assert args.lr_scheduler_type == "constant" and not args.use_vllm
    sequence = grpo_args(TrainConfig(model="m", aggregation="sequence").check(), prompts=1, group_size=2,
                         output_dir="unused", use_cpu=True)
    assert sequence.loss_type == "grpo"
    dr = grpo_args(TrainConfig(model="m", method="dr_grpo", norm_length=32).check(), prompts=1, group_size=2,
                   output_dir="unused", use_cpu=True)
    assert (dr.loss_type, dr.scale_rewards, dr.max_completion_length) == ("dr_grpo", "none", 32)
    for bad in (TrainConfig(model="m", method="rloo"), TrainConfig(model="m", mode="async")):
        with pytest.raises(ConfigError):
            grpo_args(bad.check(), prompts=1, group_size=2, output_dir="unused")
