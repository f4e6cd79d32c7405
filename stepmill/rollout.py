"""`stepmill rollout CONFIG`: every task of a dataset, n times, through the proxy, ready for training.

Each run is its own process in its own working directory, tagged with its trajectory and group
through its proxy credentials (the agent needs no change) and trusting the proxy's CA (Python,
Node, Rust clients). The runner holds the concurrency limit and the per-run timeout, shows live
progress, completes each trajectory with its exit status and duration, and scores the rewards of
the configuration. Ctrl-C stops runs cleanly (what they sent is kept; their trajectories stay
open); running again skips the runs that finished.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .client import ControlError, StepmillClient
from .proxy_env import agent_env
from .rollout_config import Config


@dataclass
class Report:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    timed_out: int = 0
    running: int = 0
    interrupted: bool = False
    trajectories: list = field(default_factory=list)


class ProxyHandle:
    """The proxy the runs go through: the configured one, or one started for the rollout."""

    def __init__(self, config: Config, db: str | None):
        proxy = config.proxy
        self.process = None
        self.confdir = os.path.expanduser(proxy.get("confdir", "~/.mitmproxy"))
        self.db = db or proxy.get("db") or "stepmill.db"
        if proxy.get("url"):
            self.url = proxy["url"]
        else:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            log = open(Path(tempfile.gettempdir()) / f"stepmill-rollout-proxy-{port}.log", "wb")
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stepmill.cli", "proxy", "--port", str(port), "--db", self.db,
                 "--confdir", self.confdir, *proxy.get("args", [])], stdout=log, stderr=subprocess.STDOUT)
        self.client = StepmillClient(proxy=self.url, confdir=self.confdir, timeout=60)
        deadline = time.time() + 60
        while True:
            try:
                self.client.health()
                break
            except OSError:
                if time.time() > deadline or (self.process and self.process.poll() is not None):
                    raise RuntimeError(f"the proxy at {self.url} does not answer") from None
                time.sleep(0.2)

    def env(self, trajectory: str, group: str) -> dict:
        parts = urllib.parse.urlsplit(self.url)
        return agent_env(parts.hostname, parts.port, self.confdir, trajectory, group)

    def close(self):
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)


def rollout(config: Config, *, db: str | None = None, progress: bool = True) -> Report:
    run, agent = config.run, config.agents[config.run.agent]
    proxy = ProxyHandle(config, db)
    from stepmill.store import Store

    store = Store(proxy.db, readonly=True)
    report = Report()
    jobs = []
    for task in config.tasks(run.dataset):
        group = f"{run.dataset}-{task['id']}"
        for i in range(run.n):
            trajectory = f"{group}-{i}"
            report.total += 1
            existing = store.trajectory(trajectory)
            if existing and existing["status"] == "complete":
                report.skipped += 1  # resume: finished before
                continue
            jobs.append((task, trajectory, group))
    stop = threading.Event()
    processes: dict[str, subprocess.Popen] = {}
    lock = threading.Lock()

    def one(task, trajectory, group):
        if stop.is_set():
            return
        metadata = {k: v for k, v in task.items() if k != "prompt"}
        metadata.update(dataset=run.dataset, task_id=task["id"], agent=agent.name)
        try:
            proxy.client.start_trajectory(trajectory_id=trajectory, group_id=group, channel=run.channel,
                                          metadata=metadata)
        except ControlError as exc:
            if exc.status != 409:
                raise
            proxy.client.update_trajectory(trajectory, metadata=metadata)  # a run cut short before: again
        workdir = tempfile.mkdtemp(prefix=f"stepmill-run-{trajectory}-")
        values = {"task": task["prompt"], "model": run.model, "workdir": workdir, "trajectory": trajectory,
                  "group": group}
        command = [part.format(**values) for part in agent.command]
        env = {**os.environ, **proxy.env(trajectory, group), **agent.env, "STEPMILL_TRAJECTORY": trajectory}
        if agent.input == "file":
            Path(workdir, agent.file).write_text(task["prompt"])
        started = time.time()
        with open(Path(workdir, "agent.log"), "wb") as log:
            # Its own process group: an agent CLI's own children stop with it.
            process = subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.PIPE if agent.input == "stdin" else subprocess.DEVNULL,
                                       start_new_session=True)
            with lock:  # registered, or stopped at once: an interrupt never misses a run that just started
                processes[trajectory] = process
                report.running += 1
                stopping = stop.is_set()
            if stopping:
                stop_group(process)
            outcome = "ok"
            try:
                process.communicate(task["prompt"].encode() if agent.input == "stdin" else None, timeout=run.timeout)
            except subprocess.TimeoutExpired:
                stop_group(process)
                outcome = "timeout"
            with lock:
                processes.pop(trajectory, None)
                report.running -= 1
        if stop.is_set():
            return  # interrupted: the trajectory stays open and runs again next time
        if outcome == "ok" and process.returncode != 0:
            outcome = "failed"
        proxy.client.update_trajectory(trajectory, metadata={
            "exit_status": process.returncode, "outcome": outcome, "duration_s": round(time.time() - started, 3),
            "workdir": workdir})
        proxy.client.complete_trajectory(trajectory)
        with lock:
            report.done += 1
            report.failed += outcome == "failed"
            report.timed_out += outcome == "timeout"
            report.trajectories.append(trajectory)

    def show():
        while not finished.wait(1.0):
            _print_progress(report, store, run.dataset)

    finished = threading.Event()
    if progress:
        threading.Thread(target=show, daemon=True).start()
    pool = ThreadPoolExecutor(run.concurrency)
    try:
        for future in [pool.submit(one, *job) for job in jobs]:
            future.result()
        pool.shutdown()
    except KeyboardInterrupt:
        report.interrupted = True
        with lock:
            stop.set()  # runs not started yet never start; running ones are stopped, their trajectories stay open
            running = list(processes.values())
        for process in running:
            stop_group(process)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        finished.set()
        if progress:
            _print_progress(report, store, run.dataset, end="\n")
        if not report.interrupted and config.rewards:
            _score(config, proxy.db, run.dataset)
        proxy.close()
    return report


def stop_group(process: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM to the run's process group, SIGKILL after ``grace`` seconds (some agents ignore TERM)."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _print_progress(report: Report, store, dataset: str, end: str = "\r") -> None:
    steps = store.query("SELECT count(*) AS n, coalesce(sum(s.output_tokens), 0) AS t FROM steps s "
                        "JOIN trajectories t ON t.id = s.trajectory_id WHERE t.id LIKE ?", [f"{dataset}-%"])[0]
    print(f"runs {report.done + report.skipped}/{report.total} done ({report.skipped} earlier), {report.running} "
          f"running, {report.failed} failed, {report.timed_out} timed out; {steps['n']} steps, "
          f"{steps['t']} output tokens   ", end=end, file=sys.stderr, flush=True)


def _score(config: Config, db: str, dataset: str) -> None:
    from stepmill.store import Store
    from stepmill.store.scoring import load_config, score

    reports = score(Store(db), load_config(config.path, other_sections=True), where="t.id LIKE :p",
                    params={"p": f"{dataset}-%"}, progress=False)
    for name, result in reports.items():
        print(f"reward {name}: scored {result.scored}, failed {result.failed}", file=sys.stderr)
