"""`stepmill rollout CONFIG`: every task of a dataset, n times, through the proxy, ready for training.

Each run is its own process in its own working directory, isolated from the runner's files
(``isolation/``), registered with the proxy and tagged through credentials that carry the run's
own secret (the agent needs no change), and trusting the proxy's CA (Python, Node, Rust clients). The runner holds the concurrency limit and the per-run timeout, shows live
progress, completes each trajectory with its exit status and duration, and scores the rewards of
the configuration. Ctrl-C stops runs cleanly (what they sent is kept; their trajectories stay
open); running again skips the runs that finished.

``[run] executor = "ray"`` runs the same runs on the nodes of a Ray cluster instead (``stepmill.fleet.ray_rollout``).
One run is the same code either way (``agent_run.py``).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Callable

from stepmill.errors import ConfigError
from stepmill.runner import isolation as iso
from stepmill.runner.agent_run import RunSite, plan, register, run_one, white_box_tokenizer
from stepmill.runner.config import Config
from stepmill.runner.context_fit import check_context_fit
from stepmill.runner.progress import Report, print_progress
from stepmill.runner.proxy_env import ensure_bundle
from stepmill.runner.proxy_handle import ProxyHandle
from stepmill.runner.run_folders import new_runs_root, runs_folder

JOIN_POLL = 0.25  # seconds the main thread waits at a time for a run's thread, so a signal reaches it
STOP_GRACE = 30.0  # seconds an interrupted rollout waits for its runs to stop before it names those that did not


class Workers:
    """Jobs on ``concurrency`` daemon threads: an interrupt never waits on a run that will not stop (the
    rollout names it and its stack, and ends). The first error stops new jobs and is raised once the
    running ones end."""

    def __init__(self, work: Callable, jobs: list, concurrency: int):
        self.work, self.todo = work, queue.SimpleQueue()
        for job in jobs:
            self.todo.put(job)
        self.errors: list[BaseException] = []
        self.current: dict[int, str] = {}  # thread ident -> the trajectory it runs
        self.cancelled = threading.Event()
        self.threads = [threading.Thread(target=self._loop, name=f"stepmill-run-{i}", daemon=True)
                        for i in range(min(concurrency, len(jobs)))]

    def _loop(self) -> None:
        while not self.cancelled.is_set():
            try:
                job = self.todo.get_nowait()
            except queue.Empty:
                return
            self.current[threading.get_ident()] = job.trajectory
            try:
                self.work(job)
            except BaseException as exc:
                self.errors.append(exc)
                self.cancelled.set()
                return
            finally:
                self.current.pop(threading.get_ident(), None)

    def run(self) -> None:
        for thread in self.threads:
            thread.start()
        for thread in self.threads:
            while thread.is_alive():
                # Never a join without end: a Ctrl-C the kernel gave another thread runs its handler only
                # once this thread runs Python again (it would wait for the runs to end on their own).
                thread.join(JOIN_POLL)
        if self.errors:
            raise self.errors[0]

    def cancel(self) -> None:
        self.cancelled.set()

    def wait(self, grace: float) -> None:
        """Up to ``grace`` seconds for the running jobs; those still running are named, with their stacks."""
        import traceback

        deadline = time.monotonic() + grace
        for thread in self.threads:
            try:
                thread.join(max(0.0, deadline - time.monotonic()))
            except RuntimeError:  # Ctrl-C came before ``run`` started this thread (or cut its start short:
                continue          # then it begins later, finds the cancel set and takes no job)
        frames = sys._current_frames()
        for thread in self.threads:
            if thread.is_alive():
                stack = "".join(traceback.format_stack(frames.get(thread.ident))) if thread.ident in frames else ""
                print(f"stepmill: run {self.current.get(thread.ident, '?')} did not stop within {grace:.0f} s; "
                      f"left behind, where it was:\n{stack}", file=sys.stderr, flush=True)


def checked_isolation(config: Config) -> str:
    """The isolation the rollout's runs get, checked before anything starts (one we cannot have is an error)."""
    mode = iso.resolve(config.isolation)
    if mode == "user":
        iso.check_user_mode(config.datasets[config.run.dataset])
    return mode


def rollout(config: Config, *, db: str | None = None, progress: bool = True) -> Report:
    """The rollout on this machine. ``executor = "ray"`` is the fleet's (``stepmill.fleet.ray_rollout``):
    the command chooses."""
    if config.run.executor == "ray":
        raise ConfigError('executor = "ray" runs on a Ray cluster: `stepmill rollout`, or '
                          'stepmill.fleet.ray_rollout.rollout_on_ray')
    mode = checked_isolation(config)
    check_context_fit(config)  # before the proxy starts: an agent that cannot fit never runs
    proxy = ProxyHandle(config, db)
    try:
        return rollout_through(config, proxy, progress=progress, mode=mode)
    finally:
        proxy.close()  # whatever happened, a proxy started here stops here


def rollout_through(config: Config, proxy: ProxyHandle, *, progress: bool = True, mode: str | None = None) -> Report:
    """The rollout's runs through a proxy the caller holds (a training loop keeps one across rounds)."""
    mode = mode or iso.resolve(config.isolation)
    run = config.run
    from stepmill.store import Store

    store = Store(proxy.db, readonly=True)
    report = Report()
    jobs = []
    for job in plan(config):
        report.total += 1
        existing = store.trajectory(job.trajectory)
        if existing and existing["status"] == "complete":
            report.skipped += 1  # resume: finished before
            continue
        jobs.append(job)
    if run.policy_version is not None:  # stamped on every step from now on, captured or submitted
        proxy.client.set_policy_version(run.policy_version)
    report.isolation = mode
    runs_root = new_runs_root(runs_folder(proxy.db, run.runs_dir), run.keep_runs_days)
    if mode == "user":
        iso.check_reachable(runs_root)
    uids = iso.UidLeases(config.isolation.first_uid)  # leased machine-wide: other rollouts' runs never share one
    site = RunSite(config, proxy, mode, runs_root, ensure_bundle(proxy.confdir), uids,
                   white_box_tokenizer(config))
    admissions: dict = {}  # trajectory -> its Admission (None while its registration is under way)
    ended: set = set()  # runs that revoked their own secret as they ended (one stopped before it started did not)
    lock = threading.Lock()

    def one(job):
        outcome = run_one(site, job, admissions[job.trajectory])
        if outcome is not None:
            ended.add(job.trajectory)
            with lock:
                report.count(outcome)

    def show():
        while not finished.wait(1.0):
            report.running = site.running
            print_progress(report, lambda: store.rollout_totals(f"{run.dataset}-"))

    finished = threading.Event()
    workers = None
    try:
        for job in jobs:
            admissions[job.trajectory] = None  # revoked too should its registration be cut short
            admissions[job.trajectory] = register(config, proxy.client, store, job)
        workers = Workers(one, jobs, run.concurrency)
        if progress:
            threading.Thread(target=show, daemon=True).start()
        workers.run()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            report.interrupted = True
        try:
            if workers is not None:
                workers.cancel()
            site.stop_all()  # runs not started yet never start; running ones are stopped, their trajectories stay open
            if workers is not None and report.interrupted:
                workers.wait(STOP_GRACE)
        finally:  # also when a second Ctrl-C cuts the wait short
            revoke_all(proxy.client, [t for t in admissions if t not in ended])
        raise
    finally:
        finished.set()
        if progress:
            report.running = site.running
            print_progress(report, lambda: store.rollout_totals(f"{run.dataset}-"), end="\n")
        if not report.interrupted and workers is not None and config.rewards:
            report.unscored = _score(config, proxy.db, run.dataset)
        store.close()  # a training loop rolls out round after round through one proxy
    return report


REVOKE_TIMEOUT = 5.0  # seconds one revocation may take on the way out (the proxy may be stopping too)


def revoke_all(client, trajectories: list[str]) -> None:
    """On the way out of a rollout cut short (Ctrl-C, an error): the secrets of the runs that never ran,
    or never ended, stop working. Their open doors would otherwise fence a proxy that outlives the
    runner (every call from no door refused) until the rollout resumes, which registers them afresh.
    Best effort, one try each, briefly: it must not turn an interrupt into another error."""
    import copy

    from stepmill.client import ControlError

    quick = copy.copy(client)
    quick.timeout = min(client.timeout, REVOKE_TIMEOUT)
    failed, why = 0, ""
    for index, trajectory in enumerate(trajectories):
        try:
            quick.revoke_run(trajectory)
        except ControlError as exc:
            # 404: never registered (its registration was cut short); 503: revoked, not yet recorded
            if exc.status not in (404, 503):
                failed, why = failed + 1, why or exc.message
        except OSError as exc:  # the proxy is gone (nothing left to fence) or stuck: stop trying
            failed, why = failed + len(trajectories) - index, str(exc)
            break
        except Exception as exc:  # an answer cut short
            failed, why = failed + 1, why or f"{type(exc).__name__}: {exc}"
    if failed:
        print(f"stepmill: the secrets of {failed} run(s) could not be revoked ({why}); the same command "
              f"registers them again", file=sys.stderr)


def _score(config: Config, db: str, dataset: str) -> str:
    """Score the rollout's complete trajectories; when the file cannot be written (a full disk), the
    reason (nothing is lost: the same command scores them once it can)."""
    from stepmill.errors import StoreUnavailable
    from stepmill.store import Store
    from stepmill.rewards.scoring import reward_specs, score

    store = Store(db)
    try:
        reports = score(store, reward_specs(config.tables, config.path, other_sections=True), id_prefix=f"{dataset}-",
                        progress=False)
    except StoreUnavailable as exc:  # the file cannot be written now (full, locked)
        return str(exc)
    finally:
        store.close()
    for name, result in reports.items():
        print(f"reward {name}: scored {result.scored}, failed {result.failed}", file=sys.stderr)
    return ""
