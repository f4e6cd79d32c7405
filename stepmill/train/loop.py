"""The closed loop: roll out through stepmill, consume whole groups, take an optimizer step, serve
the new weights on the engine (verified), stamp the next calls with the new policy version.

    sync:   version v rolls out → its groups are claimed together → one optimizer step → acked
            together → weights loaded by the paused engine as v+1, the probe checked inside it → the
            proxy stamps v+1 → generation resumes
    async:  rounds roll out continuously in a thread (collection never waits for training); the
            trainer claims what is ready within ``max_staleness`` versions, steps, acks, syncs

A version whose weights fail the probe is never served: generation stays paused, the calls the engine
held are aborted (async), and the run stops with the SyncError that names the version and the gap.

A paired control runs the same rounds (same tasks, same seeds) from the same starting weights with
no optimizer step, on its own channel, so its reward per version is the baseline the run is read
against. Every number is recorded per version in the store (``train_metrics``) for both runs.

The loop's pieces, each in its module: a round as a rollout (``rounds.py``), where the groups come
from (``consumers.py``), the policy and its optimizer step (``policy.py``), the engine's weight sync
and its probe (``engine_sync.py``), checkpoints and resume (``checkpoint.py``), what is measured of a
batch (``signals.py``). The rollout configuration is parsed once (``runner.config.load``); its [train]
table (``load_train``) and [[reward]] tables (``rewards.scoring.reward_specs``) are read from that.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

from stepmill.errors import ConfigError, SyncError
from stepmill.runner.config import Config
from stepmill.runner.proxy_handle import ProxyHandle, origin
from stepmill.runner.rollout import rollout_through
from stepmill.store import Store
from stepmill.train.config import LoraConfig, TrainConfig
from stepmill.train.checkpoint import Resume
from stepmill.train.consumers import group_consumer
from stepmill.train.rounds import round_config
from stepmill.train.signals import flat_groups, mean_reward, response_signals


@dataclass
class VersionReport:
    """What one version of one run gave: the numbers recorded in ``train_metrics``."""

    run: str
    version: int
    metrics: dict = field(default_factory=dict)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def engine_for(train: TrainConfig, url: str, served_model: str):
    """How the engine gets each new policy: vLLM's in-place reload of the full weights, or its in-place load
    of a LoRA adapter (``[train.lora]``, ``VLLMSync.sync_lora``), verified by the probe."""
    from stepmill.train.engine_sync import VLLMSync

    return VLLMSync(url, served_model, tolerance=train.probe_tolerance())


class Loop:
    """One run of the closed loop (``update=False``: its paired control)."""

    def __init__(self, config: Config, train: TrainConfig, proxy: ProxyHandle, *, run: str, update: bool,
                 progress: bool = True, resume: bool = False):
        from stepmill.train.policy import Policy

        self.config, self.train, self.proxy, self.run, self.update = config, train, proxy, run, update
        self.progress = progress
        self.channel = config.run.channel if update else f"{config.run.channel}-control"
        if train.val_dataset and train.val_dataset not in config.datasets:
            raise ConfigError(f"[train] val_dataset: no [[dataset]] named {train.val_dataset!r}")
        self.store = Store(proxy.db)
        if self.store.train_metrics(run) and not resume:
            self.store.close()
            raise ConfigError(f"{proxy.db} already holds a training run named {run!r}: give this one another name "
                              "(--name), continue it (--resume), or a new file")
        self.policy = Policy(train)  # the same starting weights and seed for a run and its control
        self.resume = Resume(proxy.db, run, self.policy, resume=resume)  # the last checkpoint's state, restored
        if self.resume.version and progress:
            say(f"[{run}] resumed from version {self.resume.version} (checkpoint in {self.resume.folder})")
        self.engine = engine_for(train, train.engine or origin(config.route.base_url), config.run.model)
        # a LoRA run's versions are an adapter the engine serves under a name of the run's own
        self.model = LoraConfig.served_name(config.run.model, run) if train.lora else None
        self.consumer = group_consumer(train, self.store, f"{run}-trainer", n=config.run.n, channel=self.channel)
        self.version = 0
        self.reports: list[VersionReport] = []

    # -- the pieces of one iteration ------------------------------------------------------------
    def serve(self, version: int) -> dict:
        """The engine serves the policy's current weights as ``version`` once they passed the probe, and the
        proxy stamps every call that starts from now on with it. A failed sync leaves the engine paused on
        weights nobody sampled from; the calls it held are aborted so the rollouts end now (SyncError)."""
        # set while the engine holds new calls, after the probe passed, from the moment it stopped taking
        # them: a call is stamped with the version whose weights serve it, in async mode too
        def stamp(paused_at: float) -> None:
            self.proxy.client.set_policy_version(version, since=paused_at)

        try:
            if self.model:
                report = self.engine.sync_lora(self.policy.model, self.policy.adapter(), str(version), name=self.model,
                                               while_paused=stamp)
            else:
                report = self.engine.sync(self.policy.model, str(version), while_paused=stamp)
        except SyncError:
            self._end_held_calls()
            raise
        self.version = version
        self.policy.serving(version)
        return {"sync_s": report.total_seconds, "engine_paused_s": report.paused_seconds,
                "logprob_gap": report.gap, "tolerance": self.engine.tolerance}

    def _end_held_calls(self) -> None:
        """After a failed sync: if the engine stayed paused, end the calls it holds (never served, since)."""
        try:
            if self.engine.is_paused():
                self.engine.abort_held()
        except SyncError as exc:  # the sync's own error is the one the run stops with
            say(f"[{self.run}] could not end the calls the paused engine holds: {exc}")

    def roll_out(self, number: int, *, version: int | None, dataset: str | None = None,
                 channel: str | None = None) -> float:
        started = time.monotonic()
        rollout_through(round_config(self.config, self.resume.rounds, number, channel=channel or self.channel,
                                     version=version, dataset=dataset, seed=self.train.seed, model=self.model),
                        self.proxy, progress=False)
        return time.monotonic() - started

    def consume(self, wanted: int, *, wait_s: float = 0.0) -> list:
        """Up to ``wanted`` ready groups, claimed together (waiting up to ``wait_s`` for the first)."""
        deadline = time.monotonic() + wait_s
        while True:
            batches = self.consumer.claim_many(wanted)
            if batches or time.monotonic() >= deadline:
                return batches
            time.sleep(0.2)

    def learn(self, batches: list, metrics: dict) -> dict:
        """One optimizer step over the groups (none for the control), its checkpoint (with ``metrics``),
        then the groups acked together; a step that fails gives them back at once. A group with no gated
        step is acked, not trained on."""
        started = time.monotonic()
        trainable = [b for b in batches if b.tensors]
        try:
            stats = self.policy.step(trainable, update=self.update) if trainable else {}
            stats["empty_groups"] = len(batches) - len(trainable)
            stats["train_s"] = time.monotonic() - started
            self.resume.save(self.version + 1, batches, {**metrics, **stats})
        except BaseException:
            self.consumer.release_many(batches)
            raise
        self.consumer.ack_many(batches)
        return stats

    def settle(self) -> list:
        """On resume: the groups of the checkpoint's step, if still leased to this name (the trainer was
        killed between the checkpoint and the ack), acked without training on them again; its metrics
        recorded if they were not. Returns the other groups this name held (the killed trainer's next
        step's, rolled out under the weights the resume serves again), still leased, to be trained on."""
        if not self.resume.version:
            return []
        held = self.consumer.claim_many(max(len(self.resume.groups), self.groups_per_round()))
        done = [b for b in held if b.meta["group_id"] in set(self.resume.groups)]
        if done:
            self.consumer.ack_many(done)
        last = self.resume.version - 1
        if self.resume.metrics and last not in {row["version"] for row in self.store.train_metrics(self.run)}:
            self.record(last, self.resume.metrics)
        return [b for b in held if b.meta["group_id"] not in set(self.resume.groups)]

    def measure(self, batches: list) -> dict:
        """Reward (of the rewarded steps: one without is left out, as in training) and the reward-hacking
        signals of the consumed groups."""
        batches = [b for b in batches if b.tensors]
        metrics = {"reward": mean_reward(batches), "groups": len(batches), "flat_groups": flat_groups(batches),
                   "trajectories": len({t for b in batches for t in b.meta["trajectory_id"]})}
        metrics.update(response_signals(batches))
        staleness = [self.version - int(v) for b in batches for v in b.meta["policy_version"]
                     if v is not None and str(v).lstrip("-").isdigit()]
        metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else None
        metrics["staleness_max"] = max(staleness) if staleness else None
        return metrics

    def validate(self, number: int) -> float | None:
        """Mean reward of a held-out rollout under the current version (the val channel, never trained on)."""
        self.roll_out(number, version=self.version, dataset=self.train.val_dataset, channel="val")
        prefix = f"{self.resume.rounds}-r{number}-{self.train.val_dataset}-"
        return self.store.mean_trajectory_reward(prefix)

    def record(self, version: int, metrics: dict) -> VersionReport:
        self.store.record_train_metrics(self.run, version, metrics)
        report = VersionReport(self.run, version, metrics)
        self.reports.append(report)
        if self.progress:
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in metrics.items() if v is not None)
            say(f"[{self.run}] version {version}: {shown}")
        return report

    # -- the loops --------------------------------------------------------------------------------
    def run_sync(self) -> list[VersionReport]:
        if self.resume.done:
            return self.history()
        synced = self.serve(self.resume.version)
        carried = self.settle()  # the killed round's groups, on the weights served again now
        groups = self.groups_per_round()
        for i in range(self.resume.version, self.train.iterations):
            version = self.version
            rollout_s = self.roll_out(i, version=version)
            wanted = groups
            if i == self.resume.version and self.resume.version:  # and the killed round's, finished after the kill
                wanted = max(2 * groups - len(carried), 1)
            batches = carried + self.consume(wanted, wait_s=30)
            carried = []
            if not batches:
                raise ConfigError(f"round {i} gave no ready group on channel {self.channel!r}: did its runs fail? "
                                  "(stepmill runs / the proxy's log)")
            metrics = {**self.measure(batches), "rollout_s": rollout_s, **synced}
            metrics.update(self.learn(batches, metrics))
            if self.train.val_every and version % self.train.val_every == 0:
                metrics["val_reward"] = self.validate(i)
            self.record(version, metrics)
            synced = self.serve(version + 1)
        self.record(self.version, {**synced, **self._final_round()})
        self.resume.finish(self.version)
        return self.history() if self.resume.version else self.reports

    def history(self) -> list[VersionReport]:
        """Every version's report as the store holds it (a resumed run's earlier versions too)."""
        return [VersionReport(self.run, row["version"], {k: v for k, v in row.items() if k not in ("run", "version")})
                for row in self.store.train_metrics(self.run)]

    def run_async(self) -> list[VersionReport]:
        if self.resume.done:
            return self.history()
        synced = self.serve(self.resume.version)
        self.consumer.release_many(self.settle())  # async: claimed again as ready, within max_staleness
        stop = threading.Event()
        rounds = {"done": 0, "error": None}

        def collect():  # never waits for training: one round after another, stamped at each call's start
            number = 0
            try:
                while not stop.is_set():
                    self.roll_out(number, version=None)
                    number += 1
                    rounds["done"] = number
            except BaseException as exc:  # the trainer reports it; collection errors end the run
                rounds["error"] = exc

        collector = threading.Thread(target=collect, name="stepmill-train-rollouts", daemon=True)
        collector.start()
        groups = self.groups_per_round()
        try:
            for _ in range(self.resume.version, self.train.iterations):
                version = self.version
                batches, waited = [], time.monotonic()
                while not batches:
                    if rounds["error"] is not None:
                        raise rounds["error"]
                    # rounds keep coming but none gives a group to train on (runs failing, groups stale)
                    if time.monotonic() - waited > 4 * self.config.run.timeout:
                        raise ConfigError(f"no ready group on channel {self.channel!r} for "
                                          f"{4 * self.config.run.timeout:.0f} s while rollouts ran")
                    batches = self.consume(groups, wait_s=5)
                metrics = {**self.measure(batches), **synced, "rounds_done": rounds["done"]}
                metrics.update(self.learn(batches, metrics))
                if self.train.val_every and version % self.train.val_every == 0:
                    # beside the rounds still rolling out: the engine serves this version until serve() below
                    metrics["val_reward"] = self.validate(version)
                self.record(version, metrics)
                synced = self.serve(version + 1)
        finally:
            stop.set()
            collector.join()
        if rounds["error"] is not None:
            raise rounds["error"]
        self.resume.finish(self.version)
        return self.history() if self.resume.version else self.reports

    def groups_per_round(self) -> int:
        return len(self.config.tasks(self.config.run.dataset)) * len(self.config.run.agent)

    def _final_round(self) -> dict:
        """The last version's reward: one more round under it, measured, not trained on."""
        n = self.train.iterations
        rollout_s = self.roll_out(n, version=self.version)
        batches = self.consume(self.groups_per_round(), wait_s=30)
        if not batches:
            raise ConfigError(f"the last round gave no ready group on channel {self.channel!r}: did its runs fail?")
        metrics = {**self.measure(batches), "rollout_s": rollout_s}
        self.consumer.ack_many(batches)
        return metrics

    def close(self) -> None:
        self.engine.close()
        close = getattr(self.consumer, "close", None)
        if close:
            close()
        self.store.close()


@dataclass
class Trained:
    """What `stepmill train` gave: the run's versions and its paired control's (None: no control)."""

    run: list[VersionReport]
    control: list[VersionReport] | None


def train_loop(config: Config, train: TrainConfig, *, db: str | None = None, progress: bool = True,
               name: str = "train", resume: bool = False) -> Trained:
    """The control (when asked) then the run, from the same starting weights, through one proxy;
    ``resume``: each from its last checkpoint (a finished one is read back from the store)."""
    proxy = ProxyHandle(config, db)
    try:
        control = None
        runs = ([(f"{name}-control", False)] if train.control else []) + [(name, True)]
        for run, update in runs:
            loop = Loop(config, train, proxy, run=run, update=update, progress=progress, resume=resume)
            try:
                reports = loop.run_async() if train.mode == "async" else loop.run_sync()
            finally:
                loop.close()
            if update:
                result = reports
            else:
                control = reports
        return Trained(result, control)
    finally:
        proxy.close()
