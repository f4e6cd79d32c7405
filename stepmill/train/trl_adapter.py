"""TRL's GRPOTrainer on stepmill's rollouts: a ``rollout_func`` that serves the trainer's current
weights on the engine, rolls the batch's tasks out through stepmill, consumes their groups and hands
TRL the engine's exact ids, logprobs and stepmill's rewards.

    rollouts = StepmillRollouts(config, proxy)           # a rollout file ([[reward]] needed), a ProxyHandle
    trainer = GRPOTrainer(model=model, args=GRPOConfig(..., use_vllm=False, num_generations=G),
                          reward_funcs=stepmill_reward, train_dataset=rollouts.dataset(),
                          processing_class=tokenizer, rollout_func=rollouts)
    trainer.train()
    rollouts.close()                                     # acknowledges the last round's groups

or all of it from a ``[train]`` table, with the optimizer steps ``stepmill train`` would take
(``grpo_args``): ``trl_train(config, train, db=...)``.

What TRL hands the function: its prompts, each repeated ``num_generations`` (G) times in a row (its
sampler repeats every dataset row G times). Each run of G is one task: one stepmill group of n = G
rollouts, and the group's trajectories come back in the place of that run, so TRL's advantages
(rewards viewed as [-1, G]) are per group.

How the weights reach the engine: before rolling out, ``VLLMSync`` writes the trainer's model as
version ``global_step`` and the engine reloads it in place (probe-verified); the proxy stamps every
call from then on with that version. TRL's own ``use_vllm`` is not used: its server mode pushes
weights over vLLM's NCCL weight-transfer engine (a CUDA device and a server started for it), and
a rollout function needs no generation backend of TRL's.

A group is acknowledged when the next round is asked for (TRL has stepped on it by then) or on
``close``. Multi-turn trajectories come as one completion: what lies between the model's turns (tool
results, template tokens) is in ``env_mask`` as 0, with logprob 0.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from stepmill.errors import ConfigError
from stepmill.private_files import private_dir, private_opener
from stepmill.runner.config import Config
from stepmill.runner.proxy_handle import ProxyHandle, origin
from stepmill.runner.rollout import rollout_through
from stepmill.store import Store
from stepmill.train.rounds import round_config
from stepmill.trainer_bridge.consume import Consumer
from stepmill.trainer_bridge.layouts import rows_from_step_batch

REWARD_FIELD = "stepmill_reward"


def stepmill_reward(prompts, completions, **fields) -> list:
    """TRL's reward function for stepmill's rollouts: the reward stepmill scored for each completion's
    trajectory (None, TRL's "unscorable", where it has none)."""
    if REWARD_FIELD not in fields:
        raise ConfigError(f"no {REWARD_FIELD!r} in the rollout's output: stepmill_reward goes with StepmillRollouts")
    return list(fields[REWARD_FIELD])


@dataclass
class RoundReport:
    """One call of the rollout function: its round, the version the engine served, what came back."""

    number: int
    version: int
    mode: str  # train | eval (TRL's, when it asked)
    group_ids: list[str]
    trajectory_ids: list[str]
    rewards: list
    seconds: dict = field(default_factory=dict)
    sync_gap: float | None = None  # the probe's largest engine-vs-trainer logprob gap (None: not synced)

    @property
    def mean_reward(self) -> float | None:
        known = [r for r in self.rewards if r is not None]
        return sum(known) / len(known) if known else None


def runs_of(prompts: list, size: int) -> list:
    """The distinct prompts of TRL's batch, in order: every ``size`` rows in a row hold one prompt."""
    if size < 1 or len(prompts) % size:
        raise ConfigError(f"TRL handed {len(prompts)} prompts, not runs of num_generations = {size}")
    heads = []
    for start in range(0, len(prompts), size):
        run = prompts[start:start + size]
        if any(p != run[0] for p in run):
            raise ConfigError(f"rows {start}..{start + size - 1} of TRL's batch are not one prompt repeated "
                              f"{size} times: a group is split (more than one process?)")
        heads.append(run[0])
    return heads


def completion_of(row) -> dict:
    """A trajectory row (``trainer_bridge.layouts.Row``) as TRL's completion: the ids before the first
    sampled token are the prompt, the rest the completion (``mask``: 1 on sampled tokens)."""
    sampled = row.loss.nonzero()[0]
    if not len(sampled):
        raise ConfigError(f"trajectory {row.trajectory_id} has no sampled token")
    first = int(sampled[0])
    return {"prompt_ids": row.ids[:first].tolist(), "completion_ids": row.ids[first:].tolist(),
            "logprobs": [float(x) for x in row.logprobs[first:]], "mask": row.loss[first:].astype(int).tolist(),
            "reward": row.reward, "trajectory_id": row.trajectory_id}


def _sample_index(trajectory_id: str) -> tuple:
    tail = trajectory_id.rsplit("-", 1)[-1]
    return (0, int(tail), trajectory_id) if tail.isdigit() else (1, 0, trajectory_id)


class StepmillRollouts:
    """The ``rollout_func`` of TRL's ``GRPOTrainer`` (``rollouts(prompts, trainer) -> dict``).

    ``config``: the rollout file (its dataset's tasks, one agent, [[reward]] tables); ``proxy``: the
    proxy the runs go through (kept by the caller); ``run``: names its rounds (``<run>-r<k>-<dataset>``)
    and its consumer (a name new to the database: a finished run's rounds are not rolled out again); ``engine``: the engine's admin origin (default: [route] base_url's); ``sync``:
    anything with ``sync(model, version)`` (default: ``VLLMSync`` on the engine, with ``tolerance``)."""

    def __init__(self, config: Config, proxy: ProxyHandle, *, run: str = "trl", engine: str | None = None,
                 tolerance: float = 1e-4, sync=None, wait_s: float = 60.0, lease_seconds: float = 600):
        if len(config.run.agent) != 1:
            raise ConfigError(f"[run] agent: one agent for TRL (one group per prompt), not {config.run.agent}")
        if not config.rewards:
            raise ConfigError(f"{config.path}: no [[reward]] table: TRL's rewards are stepmill's")
        self.config, self.proxy, self.run, self.wait_s = config, proxy, run, wait_s
        self.source = config.run.dataset
        self.tasks = config.tasks(self.source)
        self.by_prompt: dict[str, dict] = {}
        for task in self.tasks:
            if task["prompt"] in self.by_prompt:
                raise ConfigError(f"tasks {self.by_prompt[task['prompt']]['id']} and {task['id']} of {self.source} "
                                  "share a prompt: TRL hands the rollout function prompts only")
            self.by_prompt[task["prompt"]] = task
        if sync is None:
            from stepmill.train.engine_sync import VLLMSync

            sync = VLLMSync(engine or origin(config.route.base_url), config.run.model, tolerance=tolerance)
        self.engine = sync
        self.store = Store(proxy.db)
        self.lease_seconds = lease_seconds
        self.consumers: dict[str, Consumer] = {}
        self.unacked: list[tuple[Consumer, list]] = []
        self.rounds: list[RoundReport] = []
        self.version: int | None = None  # the version the engine serves (None: not synced yet)
        self.folder = private_dir(Path(tempfile.mkdtemp(prefix="stepmill-trl-")))  # a round's own task file

    def dataset(self):
        """TRL's train dataset: the tasks' prompts (one row a task, its ``task_id`` beside it)."""
        from datasets import Dataset

        return Dataset.from_list([{"prompt": t["prompt"], "task_id": t["id"]} for t in self.tasks])

    # -- the rollout function ---------------------------------------------------------------------
    def __call__(self, prompts: list, trainer) -> dict:
        if trainer.accelerator.num_processes > 1:
            raise ConfigError("StepmillRollouts runs in one process: its rounds are whole groups of one proxy")
        self.acknowledge()  # the last round's groups: TRL has taken its steps on them
        training = trainer.model.training
        size = trainer.num_generations if training else trainer.num_generations_eval
        tasks = [self.task(p) for p in runs_of(prompts, size)]
        if len({t["id"] for t in tasks}) != len(tasks):
            raise ConfigError("a task twice in one TRL batch: its two groups would be one")
        seconds = {}
        started = time.monotonic()
        version = int(trainer.state.global_step)
        gap = self.serve(trainer, version)
        seconds["sync"] = time.monotonic() - started
        number = len(self.rounds)
        channel = self.config.run.channel if training else f"{self.config.run.channel}-eval"
        round_ = self.round(number, tasks, size, channel=channel, version=version)
        started = time.monotonic()
        rollout_through(round_, self.proxy, progress=False)
        seconds["rollout"] = time.monotonic() - started
        wanted = [f"{round_.run.dataset}-{t['id']}" for t in tasks]
        consumer = self.consumer(channel, size)
        batches = self.claim(consumer, wanted)
        self.unacked.append((consumer, batches))
        by_group = {b.meta["group_id"]: b for b in batches}
        completions = []
        for group in wanted:
            rows, report = rows_from_step_batch(by_group[group])
            if len(rows) != size:
                raise ConfigError(f"group {group} gave {len(rows)} trajectory rows, not {size} ({dict(report)}): "
                                  "a failed run, a step left out by curation or one that does not continue its parent")
            for row in sorted(rows, key=lambda r: _sample_index(r.trajectory_id)):
                completions.append({**completion_of(row), "reward": self.reward(row.trajectory_id)})
        self.rounds.append(RoundReport(number, version, "train" if training else "eval", wanted,
                                       [c["trajectory_id"] for c in completions],
                                       [c["reward"] for c in completions], seconds, gap))
        output = {"prompt_ids": [c["prompt_ids"] for c in completions],
                  "completion_ids": [c["completion_ids"] for c in completions],
                  "logprobs": [c["logprobs"] for c in completions],
                  REWARD_FIELD: [c["reward"] for c in completions],
                  "trajectory_id": [c["trajectory_id"] for c in completions]}
        if any(0 in c["mask"] for c in completions):  # multi-turn: context between the turns is not trained on
            output["env_mask"] = [c["mask"] for c in completions]
        return output

    # -- its pieces ---------------------------------------------------------------------------------
    def task(self, prompt) -> dict:
        if not isinstance(prompt, str) or prompt not in self.by_prompt:
            raise ConfigError(f"a prompt TRL handed is no task's of {self.source} (train on StepmillRollouts.dataset()): "
                              f"{str(prompt)[:200]!r}")
        return self.by_prompt[prompt]

    def reward(self, trajectory_id: str) -> float | None:
        """The run's reward as stepmill trains on it (its last gated step's, else the trajectory's); None
        when it was not scored (a batch carries that as 0, TRL takes None as unscorable)."""
        steps = list(self.store.iter_steps(trajectory_id=trajectory_id, with_tokens=False, gate=True))
        if not steps:
            return None
        return max(steps, key=lambda s: -1 if s["step_index"] is None else s["step_index"])["reward"]

    def serve(self, trainer, version: int) -> float | None:
        """The trainer's current weights served by the engine as ``version`` (verified), and the proxy
        stamping every call from now on with it; nothing to do when the engine serves it already."""
        if self.version == version:
            return None
        model = trainer.accelerator.unwrap_model(trainer.model)
        report = self.engine.sync(model, str(version))
        self.proxy.client.set_policy_version(version)
        self.version = version
        return getattr(report, "gap", None)

    def round(self, number: int, tasks: list[dict], size: int, *, channel: str, version: int) -> Config:
        """The round's rollout: these tasks, ``size`` runs each, under ``<run>-r<number>-<dataset>``. A batch
        of fewer tasks than the dataset has gets a task file of its own (private, the tasks' ids kept)."""
        config = self.config
        if len(tasks) != len(self.tasks):
            path = self.folder / f"r{number}.jsonl"
            with open(path, "w", opener=private_opener) as out:
                out.writelines(json.dumps(t) + "\n" for t in tasks)
            config = copy.copy(config)
            config.datasets = {**config.datasets, self.source: str(path)}
        round_ = round_config(config, self.run, number, channel=channel, version=version)
        round_.run.n = size
        return round_

    def consumer(self, channel: str, size: int) -> Consumer:
        key = f"{channel}/{size}"
        if key not in self.consumers:
            self.consumers[key] = Consumer(self.store, f"{self.run}-trainer", n=size, channel=channel,
                                           lease_seconds=self.lease_seconds)
        return self.consumers[key]

    def claim(self, consumer: Consumer, wanted: list[str]) -> list:
        """The round's groups, claimed (waiting up to ``wait_s`` for them to be ready); ConfigError, with
        the others given back, when the channel hands out groups of something else."""
        deadline = time.monotonic() + self.wait_s
        got: list = []
        while len(got) < len(wanted):
            batches = consumer.claim_many(len(wanted) - len(got))
            foreign = [b for b in batches if b.meta["group_id"] not in wanted]
            if foreign:
                consumer.release_many(foreign + got + [b for b in batches if b not in foreign])
                raise ConfigError(f"channel {consumer.channel!r} holds groups of another rollout "
                                  f"({', '.join(b.meta['group_id'] for b in foreign[:3])}): give TRL a channel of its own")
            got += batches
            if len(got) < len(wanted):
                if time.monotonic() > deadline:
                    consumer.release_many(got)
                    missing = sorted(set(wanted) - {b.meta["group_id"] for b in got})
                    raise ConfigError(f"groups not ready after {self.wait_s:g} s: {', '.join(missing[:5])} "
                                      "(did runs fail? stepmill runs / the proxy's log)")
                time.sleep(0.2)
        return got

    def acknowledge(self) -> None:
        """The groups handed to TRL so far, marked consumed."""
        while self.unacked:
            consumer, batches = self.unacked.pop(0)
            consumer.ack_many(batches)

    def close(self, *, trained: bool = True) -> None:
        """Acknowledge the last round's groups (``trained=False``: give them back), stop the engine sync."""
        try:
            if trained:
                self.acknowledge()
            else:
                for consumer, batches in self.unacked:
                    consumer.release_many(batches)
                self.unacked.clear()
        finally:
            close = getattr(self.engine, "close", None)
            if close:
                close()
            self.store.close()
            shutil.rmtree(self.folder, ignore_errors=True)


# TRL's loss_type for each aggregation of stepmill's methods: "dapo" divides by the batch's sampled tokens
# (stepmill's token mean when one optimizer step takes the whole batch), "grpo" averages each completion's
# token mean, "dr_grpo" divides the sum by completions x max_completion_length (norm_length).
LOSS_TYPES = {"token": "dapo", "sequence": "grpo", "sum_norm": "dr_grpo"}


def grpo_args(train, *, prompts: int, group_size: int, output_dir: str, **overrides):
    """TRL's ``GRPOConfig`` for a ``[train]`` table (``TrainConfig``), so that TRL takes the optimizer
    steps ``stepmill train`` would: one step per round of ``prompts`` tasks x ``group_size`` rollouts
    (no micro-batches, no second pass), AdamW at a constant ``lr`` without weight decay, gradients
    clipped to norm 1, the ratio clipped to [1 - clip_low, 1 + clip_high], ``kl`` as beta, advantages
    scaled by the group's std for grpo, float32. ``overrides``: any other GRPOConfig field.

    What stays different: TRL adds 1e-4 to the std (stepmill 1e-6), has no dual clip (stepmill caps a
    negative advantage's loss at 3 x A), and without ``use_vllm`` its ratio is to its own logprobs
    (stepmill's is to the engine's, which the sync makes equal to 1e-4)."""
    from trl import GRPOConfig

    from stepmill.train.methods import method as rl_method

    if train.mode != "sync":
        raise ConfigError("[train] mode: TRL's GRPOTrainer trains in sync mode only (rollouts, then a step)")
    if train.method not in ("grpo", "dr_grpo"):
        raise ConfigError(f"[train] method: TRL's GRPOTrainer has grpo and dr_grpo, not {train.method!r}")
    options = {"aggregation": train.aggregation} if train.aggregation else {}
    aggregation = rl_method(train.method, **options).aggregation
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=prompts * group_size, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=group_size, max_steps=train.iterations,
        learning_rate=train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=train.kl, epsilon=train.clip_low,
        epsilon_high=train.clip_high, loss_type=LOSS_TYPES[aggregation],
        scale_rewards="group" if train.method == "grpo" else "none", temperature=1.0,
        max_completion_length=train.norm_length, use_vllm=False, bf16=False, fp16=False, seed=train.seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    return GRPOConfig(**{**settings, **overrides})


@dataclass
class TRLOutcome:
    rounds: list[RoundReport]
    trainer: object  # the GRPOTrainer, trained (its model, state.log_history)


def trl_train(config: Config, train, *, db: str | None = None, name: str = "trl", record: list | None = None,
              **overrides) -> TRLOutcome:
    """``stepmill train``'s run with TRL's GRPOTrainer taking the steps: the ``[train]`` model (float32,
    seeded as stepmill's policy), ``train.iterations`` optimizer steps, each on a round of every task of
    the dataset, ``[run] n`` rollouts each, through one proxy. ``record``: each call's (TRL's prompts,
    what the rollout function returned) is appended to it. ``overrides``: GRPOConfig fields."""
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from stepmill.train.policy import load_model

    proxy = ProxyHandle(config, db)
    output_dir = private_dir(Path(tempfile.mkdtemp(prefix="stepmill-trl-out-")))
    try:
        rollouts = StepmillRollouts(config, proxy, run=name, engine=train.engine, tolerance=train.probe_tolerance())

        def rollout_func(prompts, trainer):
            output = rollouts(prompts, trainer)
            if record is not None:
                record.append((list(prompts), output))
            return output

        try:
            args = grpo_args(train, prompts=len(rollouts.tasks), group_size=config.run.n,
                             output_dir=str(output_dir), **overrides)
            trainer = GRPOTrainer(model=load_model(train.model, train.seed), reward_funcs=stepmill_reward,
                                  args=args, train_dataset=rollouts.dataset(),
                                  processing_class=AutoTokenizer.from_pretrained(train.model), rollout_func=rollout_func)
            trainer.train()
        except BaseException:
            rollouts.close(trained=False)
            raise
        rollouts.close()
        return TRLOutcome(rollouts.rounds, trainer)
    finally:
        proxy.close()
        shutil.rmtree(output_dir, ignore_errors=True)


__all__ = ["StepmillRollouts", "RoundReport", "stepmill_reward", "runs_of", "completion_of", "REWARD_FIELD",
           "LOSS_TYPES", "grpo_args", "TRLOutcome", "trl_train"]
