"""`stepmill rollout CONFIG`: every task of a dataset, n times, through the proxy, ready for training.

Each run is its own process in its own working directory, isolated from the runner's files
(``isolation.py``), registered with the proxy and tagged through credentials that carry the run's
own secret (the agent needs no change), and trusting the proxy's CA (Python, Node, Rust clients). The runner holds the concurrency limit and the per-run timeout, shows live
progress, completes each trajectory with its exit status and duration, and scores the rewards of
the configuration. Ctrl-C stops runs cleanly (what they sent is kept; their trajectories stay
open); running again skips the runs that finished.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from stepmill.tags import encode_id, tag_path

from stepmill.private_files import private_opener

from stepmill.runner import isolation as iso
from stepmill.children import die_with_parent, free_port
from stepmill.client import ControlError, StepmillClient
from stepmill.runner.proxy_env import agent_env, ensure_bundle, trust_env
from stepmill.runner.config import Config, Route
from stepmill.auth.token import ENV as TOKEN_ENV

# What a white-box run reports of a step: only what the runner cannot know itself. Reward, policy
# version, trajectory, group, channel, model and is_last come from the runner.
WHITE_BOX_FIELDS = ("prompt_ids", "response_ids", "logprobs", "finish_reason", "messages", "completion")


@dataclass
class Report:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    timed_out: int = 0
    running: int = 0
    interrupted: bool = False
    isolation: str = ""  # the mode runs used
    trajectories: list = field(default_factory=list)
    shown_at: float = 0.0  # when progress was last written to a log


class ProxyHandle:
    """The proxy the runs go through: the configured one, or one started for the rollout."""

    def __init__(self, config: Config, db: str | None):
        proxy, route = config.proxy, config.route
        self.process = None
        self.reverse_url = None
        self.confdir = os.path.expanduser(proxy.get("confdir", "~/.mitmproxy"))
        self.db = db or proxy.get("db") or "stepmill.db"
        if proxy.get("url"):
            self.url = proxy["url"]
        else:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            args = ["--mode", f"regular@{port}"]
            if route.engines:
                args += ["--set", f"stepmill_engine_hosts={','.join(route.engines)}"]
            if route.reverse:  # agents that only take a base URL get a tagged one on a second port
                reverse_port = free_port()
                args += ["--mode", f"reverse:{origin(route.base_url)}@{reverse_port}"]
                self.reverse_url = f"http://127.0.0.1:{reverse_port}"
            self.log = Path(tempfile.gettempdir()) / f"stepmill-rollout-proxy-{port}.log"
            with open(self.log, "wb", opener=private_opener) as log:  # it names the runner's files
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "stepmill.cli", "proxy", "--port", str(port), "--db", self.db,
                     "--confdir", self.confdir, *args, *proxy.get("args", [])], stdout=log,
                    stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        from stepmill.auth.token import ensure_token

        ensure_token(self.confdir)  # a proxy started here creates it too; the client reads it now
        # Longer than the proxy's commit barrier (60 s): a complete that waits for it is answered first.
        self.client = StepmillClient(proxy=self.url, confdir=self.confdir, timeout=150)
        deadline = time.time() + 60
        while True:
            try:
                self.client.health()
                break
            except OSError:
                if time.time() > deadline or (self.process and self.process.poll() is not None):
                    self.close()
                    where = f" (its log: {self.log})" if self.process else ""
                    raise RuntimeError(f"the proxy at {self.url} does not answer{where}") from None
                time.sleep(0.2)

    def env(self, trajectory: str, secret: str, route: Route, bundle: Path) -> dict:
        """A black-box run's environment: credentials with the run's secret and the CA, or a reverse
        base URL carrying them."""
        if route.reverse and self.reverse_url:  # the credentials ride in the URL; nothing else goes through a proxy
            path = urllib.parse.urlsplit(route.base_url).path.rstrip("/")
            base_url = f"{self.reverse_url}{tag_path(trajectory, secret=secret)}{path}"
            return {"OPENAI_BASE_URL": base_url, "OPENAI_API_BASE": base_url, **trust_env(str(bundle))}
        parts = urllib.parse.urlsplit(self.url)
        env = agent_env(parts.hostname, parts.port, self.confdir, trajectory, secret=secret, bundle=str(bundle))
        if route.base_url:  # what the openai SDK, litellm and most OpenAI-compatible clients read
            env.update(OPENAI_BASE_URL=route.base_url, OPENAI_API_BASE=route.base_url)
        return env

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def rollout(config: Config, *, db: str | None = None, progress: bool = True) -> Report:
    mode = iso.resolve(config.isolation)  # before anything starts: an isolation we cannot have is an error
    if mode == "user":
        iso.check_user_mode(config.datasets[config.run.dataset])
    proxy = ProxyHandle(config, db)
    try:
        return _rollout(config, proxy, progress, mode)
    finally:
        proxy.close()  # whatever happened, a proxy started here stops here


def _rollout(config: Config, proxy: ProxyHandle, progress: bool, mode: str) -> Report:
    run = config.run
    from stepmill.store import Store

    store = Store(proxy.db, readonly=True)
    report = Report()
    jobs = []
    for task in config.tasks(run.dataset):
        for agent in [config.agents[name] for name in run.agent]:
            # One group per task and agent: rollouts of one prompt by one policy loop (GRPO).
            group = f"{run.dataset}-{task['id']}" + (f"-{agent.name}" if len(run.agent) > 1 else "")
            for i in range(run.n):
                trajectory = f"{group}-{i}"
                report.total += 1
                existing = store.trajectory(trajectory)
                if existing and existing["status"] == "complete":
                    report.skipped += 1  # resume: finished before
                    continue
                jobs.append((agent, task, trajectory, group))
    if run.policy_version is not None:  # stamped on every step from now on, captured or submitted
        proxy.client.set_policy_version(run.policy_version)
    white_box_tokenizer = config.route.tokenizer
    if not white_box_tokenizer and any(config.agents[name].entry for name in run.agent):
        from stepmill.qwen_vocab import default_folder

        white_box_tokenizer = str(default_folder())  # the bundled Qwen2 vocabulary, built once
    report.isolation = mode
    dataset_file = config.datasets[run.dataset]
    runs_root = Path(tempfile.mkdtemp(prefix="stepmill-rollout-"))
    os.chmod(runs_root, 0o711)  # other users (user mode) reach their own run folder, list none
    private = iso.Private.of(db=proxy.db, confdir=proxy.confdir, dataset=dataset_file,
                             config=str(config.path), runs_root=runs_root)
    bundle = ensure_bundle(proxy.confdir)
    public_fields = set(config.public.get(run.dataset, []))
    slots: queue.SimpleQueue = queue.SimpleQueue()  # user mode: concurrent runs never share a uid
    for slot in range(run.concurrency):
        slots.put(slot)
    stop = threading.Event()
    processes: dict[str, subprocess.Popen] = {}
    lock = threading.Lock()

    def register(agent, task, trajectory, group) -> str:
        """The run's trajectory, started (or taken back) and registered: a fresh secret, its own group
        and channel. Every run is registered before any starts, so no run can claim a later one's id."""
        # Only the fields the dataset calls public go with the trajectory; answers and tests are for
        # reward functions alone, kept where no agent-reachable surface serves them.
        metadata = {k: v for k, v in task.items() if k in public_fields}
        metadata.update(dataset=run.dataset, task_id=task["id"], agent=agent.name)
        scoring = {k: v for k, v in task.items() if k not in public_fields and k not in ("id", "prompt")}
        try:
            proxy.client.start_trajectory(trajectory_id=trajectory, group_id=group, channel=run.channel,
                                          metadata=metadata, scoring=scoring)
        except ControlError as exc:
            if exc.status != 409:
                raise
            # A run cut short before runs again — or anything else wrote under this id first: what it
            # sent stays, labelled bad so the gate keeps it out, and the run's own group and channel
            # are set again whatever that writer gave.
            proxy.client.update_trajectory(trajectory, group_id=group, channel=run.channel, metadata=metadata,
                                           scoring=scoring)
            for step_id in store.step_ids(trajectory):
                proxy.client.review(step_id, "label", "bad", reviewer="stepmill-rollout")
        # A fresh secret per run (a rerun's replaces the old): only this run's credentials write here.
        return proxy.client.register_run(trajectory)["secret"]

    secrets = {job[2]: register(*job) for job in jobs}

    def one(agent, task, trajectory, group):
        if stop.is_set():
            return
        secret = secrets[trajectory]
        slot = slots.get()
        try:
            uid = config.isolation.first_uid + slot
            run_dir = Path(tempfile.mkdtemp(prefix=encode_id(trajectory)[:80] + "-", dir=runs_root))
            workdir = run_dir / "work"
            workdir.mkdir()
            run_bundle = run_dir / "ca-bundle.pem"  # the run's own copy: the confdir stays hidden
            shutil.copyfile(bundle, run_bundle)
            os.chmod(run_bundle, 0o644)
            values = {"task": task["prompt"], "model": run.model, "workdir": str(workdir), "trajectory": trajectory,
                      "group": group, "base_url": config.route.base_url or "", "origin": origin(config.route.base_url),
                      "python": sys.executable}
            # No agent gets the write token; loopback LLMs go through the proxy too (no NO_PROXY).
            base = {k: v for k, v in iso.agent_environment(os.environ).items()
                    if k.lower() != "no_proxy" and k != TOKEN_ENV}
            direct = {k: v for k, v in base.items() if not k.lower().endswith("_proxy")}
            steps_read = steps_write = None
            if agent.entry:  # white-box: straight to the engine; its steps come back on a pipe of its own
                steps_read, steps_write = os.pipe()
                command = [sys.executable, "-m", "stepmill.agents.whitebox", agent.entry]
                env = {**direct, **trust_env(str(run_bundle)), **agent.env,
                       "STEPMILL_ENGINE_URL": config.route.base_url, "STEPMILL_MODEL": run.model,
                       "STEPMILL_TOKENIZER": white_box_tokenizer, "STEPMILL_STEPS_FD": str(steps_write)}
                # The task as the agent may see it: its id, prompt and public fields, never the answer.
                stdin = json.dumps({k: v for k, v in task.items() if k in ("id", "prompt") or k in public_fields}).encode()
            else:
                command = [fill(part, values) for part in agent.command]
                env = {**(direct if config.route.reverse else base), **proxy.env(trajectory, secret, config.route, run_bundle),
                       **{name: fill(str(value), values) for name, value in agent.env.items()}}
                stdin = task["prompt"].encode() if agent.input == "stdin" else None
                if agent.input == "file":
                    Path(workdir, agent.file).write_text(task["prompt"])
            env["STEPMILL_TRAJECTORY"] = trajectory
            if mode in ("sandbox", "user"):  # a home of its own: agent CLIs write their state there
                home = run_dir / "home"
                home.mkdir()
                env["HOME"] = str(home)
            preexec = die_with_parent
            if mode == "sandbox":
                command = iso.sandbox_command(command, run_dir=run_dir, private=private,
                                              needs=[Path(white_box_tokenizer)] if agent.entry else [])
            elif mode == "user":
                iso.end_all(uid)  # whatever a run of this uid left behind (a killed runner's) goes first
                iso.give_to(run_dir, uid)
                os.chmod(run_dir, 0o700)
                switch = iso.become(uid)
                preexec = lambda: (switch(), die_with_parent())  # noqa: E731  (a uid change clears it)
            elif mode == "container":
                env_file = run_dir / "env"
                iso.write_env_file(env_file, env)
                command = iso.container_command(command, config.isolation.prefix, workdir=workdir, env_file=env_file,
                                                uid=uid)
            else:
                print(iso.NONE_WARNING.format(trajectory=trajectory), file=sys.stderr, flush=True)
            started = time.time()
            submitted = {"steps": 0, "errors": []}
            with open(Path(workdir, "agent.log"), "wb") as log:
                # Its own process group: an agent CLI's own children stop with it. Everything it prints
                # goes to its log; a white-box run's steps come on their own pipe, which its tools never inherit.
                try:
                    process = subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                               start_new_session=True, preexec_fn=preexec,
                                               pass_fds=(steps_write,) if steps_write is not None else ())
                finally:
                    if steps_write is not None:
                        os.close(steps_write)  # the run holds the only write end: its exit ends the reader
                with lock:  # registered, or stopped at once: an interrupt never misses a run that just started
                    processes[trajectory] = process
                    report.running += 1
                    stopping = stop.is_set()
                if stopping:
                    stop_group(process)
                reader = None
                if agent.entry:
                    reader = threading.Thread(target=submit_steps, daemon=True, args=(
                        os.fdopen(steps_read, "rb"), proxy.client, submitted, {
                            "trajectory_id": trajectory, "group_id": group, "channel": run.channel, "model": run.model,
                            "metadata": {"agent": agent.name, "white_box": True}}))
                    reader.start()
                if stdin is not None:  # fed aside, so an agent that never reads it still times out
                    threading.Thread(target=feed, args=(process.stdin, stdin), daemon=True).start()
                outcome = "ok"
                try:
                    process.wait(timeout=run.timeout)
                except subprocess.TimeoutExpired:
                    stop_group(process)
                    outcome = "timeout"
                if reader is not None:
                    reader.join(30)
                with lock:
                    processes.pop(trajectory, None)
                    report.running -= 1
        finally:
            if mode == "user":
                iso.end_all(uid)  # nothing of this run lives on to meet the next run of its uid
            slots.put(slot)  # a run that failed to start frees its uid too
        if stop.is_set():
            return  # interrupted: the trajectory stays open and runs again next time
        if outcome == "ok" and (process.returncode != 0 or submitted["errors"]):
            outcome = "failed"
        proxy.client.update_trajectory(trajectory, metadata={
            "exit_status": process.returncode, "outcome": outcome, "duration_s": round(time.time() - started, 3),
            "workdir": str(workdir), "isolation": mode,
            **({"submitted_steps": submitted["steps"]} if agent.entry else {}),
            **({"submit_errors": submitted["errors"][:5]} if submitted["errors"] else {})})
        # The proxy completes a run only once every call of it is committed: rewards then see every step.
        for attempt in range(5):
            try:
                proxy.client.complete_trajectory(trajectory)
                break
            except ControlError as exc:
                if exc.status != 503:
                    raise
                print(f"stepmill: {trajectory}: {exc.message}", file=sys.stderr, flush=True)
        else:
            print(f"stepmill: {trajectory} stays open: its calls were not committed in time", file=sys.stderr)
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
    return report


PLACEHOLDER = re.compile(r"\{(task|model|workdir|trajectory|group|base_url|origin|python)\}")


def fill(template: str, values: dict) -> str:
    """Only the runner's own placeholders are replaced: other braces (JSON, TOML) stay as written."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def origin(base_url: str | None) -> str:
    """scheme://host:port of a base URL (what Anthropic clients take as ANTHROPIC_BASE_URL)."""
    if not base_url:
        return ""
    parts = urllib.parse.urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}"


def feed(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the agent exited without reading its input


def submit_steps(stream, client: StepmillClient, submitted: dict, tags: dict) -> None:
    """A white-box run's steps, one JSON line each on its own pipe, submitted with the runner's
    credential as they come. Of each line only the ids and what the engine said are taken."""
    with stream:
        for index, line in enumerate(stream):
            try:
                step = json.loads(line)
                if not isinstance(step, dict):
                    raise ValueError("a step is a JSON object")
                reported = {name: step[name] for name in WHITE_BOX_FIELDS if step.get(name) is not None}
                first = {"parent_step_id": None} if index == 0 else {}  # a root, even after a cut-short run
                client.submit_step(**reported, **tags, **first, step_index=index)
                submitted["steps"] += 1
            except (ValueError, ControlError) as exc:
                submitted["errors"].append(f"step {index}: {exc}")


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


def _print_progress(report: Report, store, dataset: str, end: str | None = None) -> None:
    """One line, redrawn in place on a terminal; a line every few seconds in a log."""
    if end is None:
        if not sys.stderr.isatty():
            now = time.monotonic()
            if now - report.shown_at < 5:
                return
            report.shown_at = now
        end = "\r" if sys.stderr.isatty() else "\n"
    steps = store.rollout_totals(f"{dataset}-")
    print(f"runs {report.done + report.skipped}/{report.total} done ({report.skipped} earlier), {report.running} "
          f"running, {report.failed} failed, {report.timed_out} timed out; {steps['steps']} steps, "
          f"{steps['output_tokens']} output tokens   ", end=end, file=sys.stderr, flush=True)


def _score(config: Config, db: str, dataset: str) -> None:
    from stepmill.store import Store
    from stepmill.rewards.scoring import load_config, score

    reports = score(Store(db), load_config(config.path, other_sections=True), id_prefix=f"{dataset}-",
                    progress=False)
    for name, result in reports.items():
        print(f"reward {name}: scored {result.scored}, failed {result.failed}", file=sys.stderr)
