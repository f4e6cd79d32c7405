"""One run of an agent, on the machine whose proxy records it: registered with a secret, started
isolated, stopped at its timeout, then completed with its outcome. The local runner calls it from its
threads; a Ray rollout calls the same code from a run's task on the node (``stepmill/fleet/ray_node.py``)."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from stepmill.auth.write_token import ENV as TOKEN_ENV
from stepmill.client import ControlError, StepmillClient
from stepmill.runner import isolation as iso
from stepmill.runner.config import Config
from stepmill.runner.context_fit import engine_context, new_tokens
from stepmill.auth.secret_hashes import secret_hash
from stepmill.runner.door import Doors, Way, new_key, way_to
from stepmill.runner.door_answers import EngineAnswers
from stepmill.runner.isolation.files import module_folders
from stepmill.runner.limits import CappedLog, RunGroup
from stepmill.runner.proxy_handle import ProxyHandle, origin
from stepmill.runner.proxy_env import trust_env
from stepmill.runner.run_folders import new_run_folder

# What a white-box run reports of a step: only what the runner cannot know itself. Reward, policy
# version, trajectory, group, channel, model and is_last come from the runner.
WHITE_BOX_FIELDS = ("prompt_ids", "response_ids", "logprobs", "finish_reason", "messages", "completion")


@dataclass
class Job:
    """One run to make: an agent on a task, its trajectory and group ids (the runner's, the same on every node)."""

    agent: object  # config.Agent
    task: dict
    trajectory: str
    group: str
    sample: int = 0  # which of the group's n runs


def run_seed(seed: int | None, job: Job) -> int | None:
    """A run's sampling seed: the same for the same task and sample under the same ``[run] seed`` (a run and
    its paired control draw alike), different across them."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{job.task['id']}:{job.sample}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class RunSite:
    """Where runs execute: one proxy and its database, the runs' root folder, what runs must not see.
    ``running`` counts the runs whose process is alive; ``processes`` lets an interrupt stop them."""

    config: Config
    proxy: ProxyHandle
    mode: str  # the isolation runs use (isolation.resolve)
    runs_root: Path
    bundle: Path  # the proxy's CA with the system's, copied into each run's folder
    uids: iso.UidLeases  # the host uids runs become (user mode, a root runner's sandbox): one run each
    white_box_tokenizer: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    processes: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    doors_lock: threading.Lock = field(default_factory=threading.Lock)
    made_doors: Doors | None = None
    context_lock: threading.Lock = field(default_factory=threading.Lock)
    read_context: list = field(default_factory=list)  # the engine's context, once read: [length or None]

    @functools.cached_property
    def private(self) -> iso.Private:
        run = self.config.run
        private = iso.Private.of(db=self.proxy.db, confdir=self.proxy.confdir, dataset=self.config.datasets[run.dataset],
                                 config=str(self.config.path), runs_root=self.runs_root)
        # What of a task library would give answers away (its data, its generator) is hidden too.
        private.folders += [Path(path) for path in getattr(self.config, "library_paths", {}).get(run.dataset, [])]
        return private

    @functools.cached_property
    def policy(self) -> iso.Policy:
        """Its isolation mode's rules: what each run sees, how it is started, how it ends."""
        return iso.policy(self.mode, self.config.isolation, self.private)

    @property
    def doors(self) -> Doors:
        """One door thread for every run: runs start on several threads at once, and a run's door
        answers (what its engine said) are read where it was opened."""
        with self.doors_lock:
            if self.made_doors is None:
                self.made_doors = Doors()
            return self.made_doors

    def new_tokens(self, agent) -> int:
        """A run's ``{max_new_tokens}`` (``context_fit.new_tokens``): the engine's context is asked once a
        rollout, by the first run that needs it (none where ``[run] max_new_tokens`` is set)."""
        run, base_url = self.config.run, self.config.route.base_url
        if not run.max_new_tokens:
            with self.context_lock:
                if not self.read_context:
                    self.read_context.append(engine_context(base_url, run.model) if base_url else None)
        context = self.read_context[0] if self.read_context else None
        return new_tokens(run.max_new_tokens, agent.prompt_tokens, context)

    def stop_all(self) -> None:
        """Runs not started yet never start; running ones are stopped, their trajectories stay open."""
        with self.lock:
            self.stop.set()
            running = list(self.processes.values())
        for process in running:
            stop_group(process)


def white_box_tokenizer(config: Config) -> str | None:
    tokenizer = config.route.tokenizer
    if not tokenizer and any(config.agents[name].entry for name in config.run.agent):
        from stepmill.qwen_vocab import default_folder

        tokenizer = str(default_folder())  # the bundled Qwen2 vocabulary, built once
    return tokenizer


def plan(config: Config) -> list[Job]:
    """Every run of the rollout, in order: n per task and agent, one group per task and agent."""
    run = config.run
    jobs = []
    for task in config.tasks(run.dataset):
        for agent in [config.agents[name] for name in run.agent]:
            # One group per task and agent: rollouts of one prompt by one policy loop (GRPO).
            group = f"{run.dataset}-{task['id']}" + (f"-{agent.name}" if len(run.agent) > 1 else "")
            jobs.extend(Job(agent, task, f"{group}-{i}", group, i) for i in range(run.n))
    return jobs


@dataclass(frozen=True)
class Admission:
    """What registering a run gave: its secret, and a sandboxed run's door key (None otherwise), which
    only the runner's side of its door holds."""

    secret: str
    door: str | None = None


def with_door(config: Config) -> bool:
    """Whether runs get a network of their own, their door the only way out (sandbox, network = own)."""
    return config.isolation.network == "own" and iso.resolve(config.isolation) == "sandbox"


def register(config: Config, client: StepmillClient, store, job: Job) -> Admission:
    """The run's trajectory, started (or taken back) and registered: a fresh secret, its own group
    and channel. Every run is registered before any starts, so no run can claim a later one's id."""
    run = config.run
    public_fields = set(config.public.get(run.dataset, []))
    task, trajectory = job.task, job.trajectory
    # Only the fields the dataset calls public go with the trajectory; answers and tests are for
    # reward functions alone, kept where no agent-reachable surface serves them.
    metadata = {k: v for k, v in task.items() if k in public_fields}
    metadata.update(dataset=run.dataset, task_id=task["id"], agent=job.agent.name)
    scoring = {k: v for k, v in task.items() if k not in public_fields and k not in ("id", "prompt")}
    try:
        client.start_trajectory(trajectory_id=trajectory, group_id=job.group, channel=run.channel,
                                metadata=metadata, scoring=scoring)
    except ControlError as exc:
        if exc.status != 409:
            raise
        # A run cut short before runs again — or anything else wrote under this id first: what it
        # sent stays, labelled bad so the gate keeps it out, and the run's own group and channel
        # are set again whatever that writer gave.
        client.update_trajectory(trajectory, group_id=job.group, channel=run.channel, metadata=metadata,
                                 scoring=scoring)
        for step_id in store.step_ids(trajectory):
            client.review(step_id, "label", "bad", reviewer="stepmill-rollout")
    # A fresh secret per run (a rerun's replaces the old): only this run's credentials write here.
    if not with_door(config):
        return Admission(client.register_run(trajectory)["secret"])
    door = new_key()
    answer = client.register_run(trajectory, door=secret_hash(door), hosts=route_hosts(config))
    return Admission(answer["secret"], door)


# A rollout without route.base_url: its agents call their vendors' APIs as they ship (Claude Code
# Anthropic's, Codex OpenAI's, Gemini CLI Google's), and those are the LLM its runs may reach.
VENDOR_APIS = ("api.openai.com:443", "api.anthropic.com:443", "generativelanguage.googleapis.com:443")


def route_hosts(config: Config) -> list[str]:
    """Where a sandboxed run may reach through the proxy: its LLM's host and port (without a route, the
    public APIs agents call as they ship), the engines, and ``[isolation] allow_hosts`` (a host named
    without a port: 443 and 80)."""
    hosts = list(VENDOR_APIS)
    if config.route.base_url:
        parts = urllib.parse.urlsplit(config.route.base_url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        hosts = [f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"]
    return hosts + list(config.route.engines) + list(config.isolation.allow_hosts)


@dataclass
class Outcome:
    trajectory: str
    outcome: str  # ok | failed | timeout
    committed: bool  # the proxy completed it: every call of it is in the database


def run_one(site: RunSite, job: Job, admission: Admission) -> Outcome | None:
    """Run the job's agent to its end or its timeout and complete its trajectory; None when the site
    was stopped (the trajectory stays open and runs again next time). A run that cannot start for a full
    disk fails with the reason; the rollout goes on."""
    try:
        return _run_one(site, job, admission)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"stepmill: {job.trajectory} failed: {exc}", file=sys.stderr, flush=True)
        try:
            site.proxy.client.update_trajectory(job.trajectory, metadata={"outcome": "failed", "error": str(exc)})
            site.proxy.client.complete_trajectory(job.trajectory)
            return Outcome(job.trajectory, "failed", committed=True)
        except ControlError:
            return Outcome(job.trajectory, "failed", committed=False)


def _run_one(site: RunSite, job: Job, admission: Admission) -> Outcome | None:
    if site.stop.is_set():
        return None
    uid = site.uids.take()
    place = running = None
    try:
        place = iso.RunPlace(new_run_folder(site.runs_root, job.trajectory), job.trajectory, uid)
        running = _prepare(site, job, admission, place)
        _launch(site, running)
        _wait(site, running)
    finally:
        if place is not None:
            site.policy.end(place)  # however it ended, or if it never started: what its mode leaves behind goes
        site.uids.give(uid)  # a run that failed to start frees its uid too
        if admission.door is not None:
            site.doors.close(job.trajectory)
            site.doors.forget(job.trajectory)  # its step reader is done (or given up on)
        # Ended, failed, timed out or stopped: whatever the run left behind writes nothing more with its
        # secret (a rerun is registered with a new one).
        revoke(site.proxy.client, job.trajectory)
    if site.stop.is_set():
        return None  # interrupted: the trajectory stays open and runs again next time
    return _record(site, running)


@dataclass
class Running:
    """One run on its way: where it is, what it runs, and what it did."""

    job: Job
    admission: Admission
    place: iso.RunPlace
    command: list
    env: dict
    stdin: bytes | None = None
    steps: tuple = (None, None)  # a white-box run's steps pipe: read end, write end
    limited: RunGroup | None = None
    log: CappedLog | None = None
    process: subprocess.Popen | None = None
    started: float = 0.0
    outcome: str = "ok"
    hit: list = field(default_factory=list)
    submitted: dict = field(default_factory=lambda: {"steps": 0, "errors": []})


def _prepare(site: RunSite, job: Job, admission: Admission, place: iso.RunPlace) -> Running:
    """The run's folder filled, its command and environment, as its isolation mode shapes them."""
    agent, trajectory, run_dir = job.agent, job.trajectory, place.run_dir
    place.workdir.mkdir()
    run_bundle = run_dir / "ca-bundle.pem"  # the run's own copy: the confdir stays hidden
    shutil.copyfile(site.bundle, run_bundle)
    os.chmod(run_bundle, 0o644)
    running = Running(job, admission, place, *_command_and_env(site, job, admission.secret, place, run_bundle))
    place.needs = [Path(site.white_box_tokenizer)] if agent.entry else []
    place.needs += module_folders(running.command, agent.entry, running.env.get("PYTHONPATH"))
    if admission.door is not None:  # its only ways out: the proxy (and a white-box run's engine), by its door
        place.door, place.door_folder = site.doors.open(trajectory, admission.door, ways(site, agent))
        place.needs.append(place.door_folder)
    running.env.update(site.policy.sees(place))
    return running


def _command_and_env(site: RunSite, job: Job, secret: str, place: iso.RunPlace, run_bundle: Path) -> tuple:
    """What the run executes, its environment (by allow-list: ``isolation/environment.py``), its stdin,
    and a white-box run's steps pipe."""
    config, proxy, run, agent, task = site.config, site.proxy, site.config.run, job.agent, job.task
    seed = run_seed(run.seed, job)
    seeded = {"STEPMILL_SEED": str(seed)} if seed is not None else {}
    values = {"task": task["prompt"], "model": run.model, "workdir": str(place.workdir), "trajectory": job.trajectory,
              "group": job.group, "base_url": config.route.base_url or "", "origin": origin(config.route.base_url),
              "python": sys.executable, "examples": str(EXAMPLES), "seed": "" if seed is None else str(seed),
              "max_new_tokens": str(site.new_tokens(agent))}
    # No agent gets the write token; loopback LLMs go through the proxy too (no NO_PROXY).
    base = {k: v for k, v in iso.agent_environment(os.environ, config.isolation.pass_env).items()
            if k.lower() != "no_proxy" and k != TOKEN_ENV}
    direct = {k: v for k, v in base.items() if not k.lower().endswith("_proxy")}
    if agent.entry:  # white-box: straight to the engine; its steps come back on a pipe of its own
        steps = os.pipe()
        command = [sys.executable, "-m", "stepmill.agents.whitebox", agent.entry]
        env = {**direct, **trust_env(str(run_bundle)), **agent.env,
               "STEPMILL_ENGINE_URL": config.route.base_url, "STEPMILL_MODEL": run.model,
               "STEPMILL_TOKENIZER": site.white_box_tokenizer, "STEPMILL_STEPS_FD": str(steps[1]), **seeded}
        # The task as the agent may see it: its id, prompt and public fields, never the answer.
        public_fields = set(config.public.get(run.dataset, []))
        stdin = json.dumps({k: v for k, v in task.items() if k in ("id", "prompt") or k in public_fields}).encode()
    else:
        steps = (None, None)
        command = [fill(part, values) for part in agent.command]
        env = {**(direct if config.route.reverse else base),
               **proxy.env(job.trajectory, secret, config.route, run_bundle), **seeded,
               **{name: fill(str(value), values) for name, value in agent.env.items()}}
        stdin = task["prompt"].encode() if agent.input == "stdin" else None
        if agent.input == "file":
            Path(place.workdir, agent.file).write_text(task["prompt"])
    env["STEPMILL_TRAJECTORY"] = job.trajectory
    return command, env, stdin, steps


def _launch(site: RunSite, running: Running) -> None:
    """Started in its own control group (or rlimits), its own session, its output into its log."""
    limits = site.config.isolation.limits
    place, steps_write = running.place, running.steps[1]
    # Its own control group where the machine allows (processes and memory limited whole), rlimits else.
    running.limited = limited = RunGroup.make(f"stepmill-{place.run_dir.name}", limits,
                                              counts_inside=site.policy.counts_own_processes)
    start = site.policy.start(place, running.command, running.env, limited.nproc_inside())
    enter, outer = limited.enter, start.preexec or (lambda: None)
    # Everything it prints goes to its log, capped (head and tail kept); a white-box run's steps come
    # on their own pipe, which its tools never inherit.
    running.log = CappedLog(place.workdir / "agent.log", limits.log_kb * 1024)
    running.started = time.time()
    try:  # its own process group: an agent CLI's own children stop with it
        running.process = subprocess.Popen(
            start.command, cwd=place.workdir, env=running.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if running.stdin is not None else subprocess.DEVNULL, start_new_session=True,
            preexec_fn=lambda: (enter(), outer()),  # into its group as root, before a uid change
            pass_fds=(steps_write,) if steps_write is not None else ())
    except BaseException:
        running.log.follow(_Empty())
        limited.remove()
        raise
    finally:
        if steps_write is not None:
            os.close(steps_write)  # the run holds the only write end: its exit ends the reader
    running.log.follow(running.process.stdout)


def _wait(site: RunSite, running: Running) -> None:
    """Until it ends or times out; then what it ran into, and nothing of it left running."""
    job, process, trajectory, run = running.job, running.process, running.job.trajectory, site.config.run
    with site.lock:  # registered, or stopped at once: an interrupt never misses a run that just started
        site.processes[trajectory] = process
        site.running += 1
        stopping = site.stop.is_set()
    if stopping:
        stop_group(process)
    reader = None
    if job.agent.entry:
        reader = threading.Thread(target=submit_steps, daemon=True, args=(
            os.fdopen(running.steps[0], "rb"), site.proxy.client, running.submitted, {
                "trajectory_id": trajectory, "group_id": job.group, "channel": run.channel, "model": run.model,
                "metadata": {"agent": job.agent.name, "white_box": True}},
            site.doors.engine_answers(trajectory) if running.admission.door is not None else None))
        reader.start()
    if running.stdin is not None:  # fed aside, so an agent that never reads it still times out
        threading.Thread(target=feed, args=(process.stdin, running.stdin), daemon=True).start()
    try:
        process.wait(timeout=run.timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
        running.outcome = "timeout"
    if reader is not None:
        reader.join(30)
    running.submitted["closed"] = True  # a line something of the run writes later is not taken
    running.hit = running.limited.hit()
    running.limited.remove()  # what is left of the run (a user-mode daemon) is killed with its group
    running.log.wait(10)  # a leftover holding its output keeps the log's thread, not the runner
    with site.lock:
        site.processes.pop(trajectory, None)
        site.running -= 1


def _record(site: RunSite, running: Running) -> Outcome:
    """Its outcome on its trajectory (its log linked), then the trajectory completed."""
    proxy, trajectory, process, submitted = site.proxy, running.job.trajectory, running.process, running.submitted
    outcome, log = running.outcome, running.log
    if outcome == "ok" and (process.returncode != 0 or submitted["errors"]):
        outcome = "failed"
    try:
        proxy.client.update_trajectory(trajectory, metadata={
            "exit_status": process.returncode, "outcome": outcome,
            "duration_s": round(time.time() - running.started, 3), "workdir": str(running.place.workdir),
            "log": str(log.path), "isolation": site.mode, "limits": running.limited.record(),
            **({"limits_hit": running.hit} if running.hit else {}),
            **({"output_cut_bytes": log.cut} if log.cut else {}),
            **({"log_error": log.error} if log.error else {}),
            **({"submitted_steps": submitted["steps"]} if running.job.agent.entry else {}),
            **({"submit_errors": submitted["errors"][:5]} if submitted["errors"] else {})})
    except ControlError as exc:  # a full disk under the database: the run's record waits, the rollout goes on
        if exc.status != 503:
            raise
        print(f"stepmill: {trajectory}: its outcome could not be recorded: {exc.message}", file=sys.stderr, flush=True)
    # The proxy completes a run only once every call of it is committed: rewards then see every step.
    for attempt in range(5):
        try:
            proxy.client.complete_trajectory(trajectory)
            return Outcome(trajectory, outcome, committed=True)
        except ControlError as exc:
            if exc.status != 503:
                raise
            print(f"stepmill: {trajectory}: {exc.message}", file=sys.stderr, flush=True)
    print(f"stepmill: {trajectory} stays open: its calls were not committed in time", file=sys.stderr)
    return Outcome(trajectory, outcome, committed=False)


class _Empty:
    """The output of a run that never started."""

    def read1(self, size: int) -> bytes:
        return b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def revoke(client: StepmillClient, trajectory: str) -> None:
    for attempt in range(5):
        try:
            client.revoke_run(trajectory)
            return
        except ControlError as exc:
            if exc.status != 503:
                raise
        except OSError:
            time.sleep(1)
    print(f"stepmill: {trajectory}: its revocation could not be recorded (the proxy refuses its secret all the "
          f"same while it runs); its late calls stay out of the gate", file=sys.stderr, flush=True)


def ways(site: RunSite, agent) -> list[Way]:
    """What a sandboxed run reaches through its door: the proxy (its reverse listener too), and a
    white-box run's engine (straight, admin routes refused). Each on the port its URL names, on the
    run's own loopback: the URLs it was given work unchanged."""
    proxy = site.proxy
    found = [way_to(proxy.url)]
    if proxy.reverse_url:
        found.append(way_to(proxy.reverse_url))
    if agent.entry:
        found.append(way_to(site.config.route.base_url, http_gate=True))
    for way in found:
        if way.host not in ("127.0.0.1", "localhost"):
            raise iso.IsolationError(f"isolation = sandbox with network = own reaches the proxy and the engine on "
                                     f"this machine's loopback only, not {way.host}: set [isolation] network = "
                                     f"\"host\"")
    return found


# {examples}: the example agents shipped for agent frameworks (stepmill/agents/frameworks), run on the
# framework's own interpreter, which the recipe names. {max_new_tokens}: what one call may add, the output cap
# a recipe gives its CLI (RunSite.new_tokens).
PLACEHOLDER = re.compile(r"\{(task|model|workdir|trajectory|group|base_url|origin|python|examples|max_new_tokens)\}")
EXAMPLES = Path(__file__).resolve().parent.parent / "agents" / "frameworks"


def fill(template: str, values: dict) -> str:
    """Only the runner's own placeholders are replaced: other braces (JSON, TOML) stay as written."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def feed(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the agent exited without reading its input


UNBACKED = "no engine answer carried these ids"  # a white-box line its engine door never saw answered


def engine_versions(said: dict, tags: dict) -> dict:
    """The policy version from the engine's own word, as the run's engine door read it
    (``EngineAnswers.claim``: vLLM's token route names the weight version that sampled each token):
    the version its first token was sampled with, and every span when a weight sync fell inside the
    generation. Nothing where the engine did not say (or says only "default", never synced): the step
    is then stamped by when the door saw its request."""
    spans = said.get("weight_versions")
    if not (isinstance(spans, list) and spans and all(isinstance(span, dict) for span in spans)):
        return {}
    versions = [str(span.get("version"))[:200] for span in spans]
    if "default" in versions:
        return {}
    metadata = {**tags.get("metadata", {}), "version_from": "engine"}
    if len(set(versions)) > 1:
        metadata["weight_versions"] = spans
    return {"policy_version": versions[0], "metadata": metadata}


def submit_steps(stream, client: StepmillClient, submitted: dict, tags: dict,
                 answers: EngineAnswers | None = None) -> None:
    """A white-box run's steps, one JSON line each on its own pipe, submitted with the runner's
    credential as they come. Of each line only the ids and what it says the engine answered are
    taken. With an engine door (``answers``) a line stands only for an answer the door saw carry its
    output ids (else it is refused: the run made those tokens up), and its policy version and start
    are what the door saw, never fields of the line; without one, the line's start is held inside
    what the runner saw."""
    floor = time.time()  # a generation began after the run started, and after the line before it came
    with stream:
        for index, line in enumerate(stream):
            if submitted.get("closed"):
                break
            try:
                step = json.loads(line)
                if not isinstance(step, dict):
                    raise ValueError("a step is a JSON object")
                reported = {name: step[name] for name in WHITE_BOX_FIELDS if step.get(name) is not None}
                first = {"parent_step_id": None} if index == 0 else {}  # a root, even after a cut-short run
                now = time.time()
                said = answers.claim(step.get("response_ids")) if answers is not None else {}
                if said is None:
                    raise ValueError(UNBACKED)
                started = said.get("asked_at") or _reported_start(step.get("started_at"), floor, now)
                floor = now
                client.submit_step(**{**reported, **tags, **first, **engine_versions(said, tags)}, step_index=index,
                                   started_at=started)
                submitted["steps"] += 1
            except (ValueError, ControlError) as exc:
                submitted["errors"].append(f"step {index}: {exc}")


def _reported_start(started, floor: float, now: float) -> float:
    """When a generation began as a run without an engine door says, held inside what the runner saw."""
    if isinstance(started, (int, float)) and math.isfinite(started):
        return min(max(float(started), floor), now)
    return floor


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
