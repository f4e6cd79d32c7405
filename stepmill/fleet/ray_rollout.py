"""`[run] executor = "ray"`: a rollout's runs on the nodes of a Ray cluster, driven from the runner.

Topology. One ``Node`` actor (``ray_node.py``) per alive Ray node with CPUs, pinned to it
(``NodeAffinitySchedulingStrategy``, ``soft=False``): the node's `stepmill proxy` on its own SQLite
file in ``run.node_dir`` on the node's local disk, and its `stepmill serve`. Each run is a Ray task
pinned to its node, running exactly as a local run does (same isolation, same environment, the node's
proxy); at most ``run.runs_per_node`` at once on each node (default ``run.concurrency``).

Placement. A group (the n runs of one task and agent) stays whole on one node: its steps are in one
file, scored there, and served from there. A group some of whose runs an earlier rollout left in a
node's file goes back to that node; every other group goes to the node with the fewest runs so far.

Ids. Trajectory and group ids come from the runner (``<dataset>-<task id>[-<agent>]-<i>``, as on one
machine) and each run is placed on exactly one node, so they never collide across nodes (the
coordinator refuses a run registered on a second node); step ids are random (80 bits) in every file.
A node's name, its file's name and its id in the coordinator are ``node-<address>``, with the Ray
node id's first 8 characters added where several Ray nodes share an address (a local test cluster).

Resume. A run whose trajectory is complete in a node's file is not run again. Scoring runs on each
node against its file (the node actor), group by group as soon as a group's runs have all finished.

Healing. Each node's actor restarts its proxy (and serve) where it dies, same ports and file
(``ray_node.py``). ``NodeWatch`` asks every node each pass whether its proxy is up and in which
generation (how often it died): a run that ends after its node's proxy died under it, or whose task
was lost, is cut, and runs again on its node once the proxy answers — registered anew, so what the cut
attempt wrote is labelled bad — at most ``run.retries`` times. A node whose proxy cannot come back is
lost: its groups with runs still to make move whole to the live node with the fewest runs queued, the
coordinator re-places their runs there (``move_group``), and the lost file's copies are set aside.
Each restart, rerun and move is a node event in the coordinator.

Coordinator. With ``run.coordinator`` or ``$STEPMILL_COORDINATOR``, each node registers itself (its
serve URL) and heartbeats while the rollout runs; the runner registers each group (its size, n) and
each run (on its node) before any run starts, and reports each run finished and committed (the proxy
completed it: its calls are in the node's file) when it ends, and scored when its group was scored,
so groups become ready for claims while the rollout goes on.

Ctrl-C cancels the runs' tasks (each stops its run's process group; trajectories stay open), stops
every node's proxy and serve, and the command exits 130, as on one machine.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time

from stepmill.errors import ConfigError
from stepmill.fleet.ray_node import Node, Where, run_on_node
from stepmill.runner.agent_run import Job, plan
from stepmill.runner.config import Config
from stepmill.runner.progress import Report, print_progress
from stepmill.runner.rollout import checked_isolation

CANCEL_GRACE_S = 15.0  # a cancelled run's task stops its agent (SIGTERM, then SIGKILL after 3 s)
STOP_NODE_S = 60.0


def node_names(nodes: list[dict]) -> dict[str, str]:
    """Ray node id -> the node's name: ``node-<address>``, plus the Ray id's start where an address repeats."""
    shared = collections.Counter(n["NodeManagerAddress"] for n in nodes)
    return {n["NodeID"]: f"node-{n['NodeManagerAddress']}" + (f"-{n['NodeID'][:8]}"
                                                               if shared[n["NodeManagerAddress"]] > 1 else "")
            for n in nodes}


def place(jobs: list[Job], names: list[str], found: dict[str, dict[str, str]]) -> dict[str, str]:
    """group -> node name: whole groups, back where an earlier rollout left any of their runs, else on the
    node with the fewest runs so far (ties: in the nodes' order)."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.group, []).append(job)
    placed, load = {}, dict.fromkeys(names, 0)
    for group, members in groups.items():
        earlier = [name for name in names if any(job.trajectory in found[name] for job in members)]
        placed[group] = earlier[0] if earlier else min(names, key=lambda name: load[name])
        load[placed[group]] += len(members)
    return placed


def rollout_on_ray(config: Config, *, progress: bool = True) -> Report:
    """The rollout's runs on the Ray cluster's nodes (`stepmill rollout` with ``executor = "ray"``)."""
    import ray

    mode = checked_isolation(config)
    run = config.run
    coordinator_url = run.coordinator or os.environ.get("STEPMILL_COORDINATOR") or None
    if run.serve == "keep" and not coordinator_url:
        raise ConfigError('[run] serve = "keep" serves each node\'s file until the coordinator says its groups are'
                          " consumed: it needs a coordinator ([run] coordinator or STEPMILL_COORDINATOR)")
    started_ray = not ray.is_initialized()
    if started_ray:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=run.ray_address, log_to_driver=True, configure_logging=False)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():  # the command's own Ctrl-C handling, not Ray's exit
                signal.signal(sig, handler)
    fleet = None
    actors: dict[str, object] = {}
    keep = False  # the nodes' serves kept: only after a rollout that ended, not one stopped by Ctrl-C
    try:
        if coordinator_url:
            from stepmill.store.fleet_ledger import Coordinator

            fleet = Coordinator(coordinator_url)
        report = _drive(config, mode, progress, fleet, coordinator_url, actors)
        keep = run.serve == "keep"
        return report
    finally:
        _stop_nodes(actors, keep)
        if fleet is not None:
            fleet.close()
        if started_ray:
            ray.shutdown()


def _start_nodes(config: Config, coordinator_url: str | None, actors: dict) -> dict[str, Where]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # A node with no CPU for tasks (a head kept free, as clusters often set it up) gets no runs.
    alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    if not alive:
        raise ConfigError("executor = ray: the Ray cluster has no alive node with CPUs to run on")
    names = node_names(alive)
    remote = ray.remote(Node)
    for node in sorted(alive, key=lambda n: names[n["NodeID"]]):
        name = names[node["NodeID"]]
        # num_cpus=0: a node's actor and its runs' tasks wait on processes; the runner limits runs per node.
        actors[name] = remote.options(
            num_cpus=0, max_concurrency=8, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(name, config, config.run.node_dir, coordinator_url)
    wheres = ray.get([actor.info.remote() for actor in actors.values()])
    return dict(zip(actors, wheres))


def _stop_nodes(actors: dict, keep: bool = False) -> None:
    import ray

    from stepmill.fleet.keep_serving import KEEP_UP_S

    stops = {name: actor.stop.remote(keep) for name, actor in actors.items()}  # all at once, each waited for
    for name, stop in stops.items():
        try:
            ray.get(stop, timeout=STOP_NODE_S + (KEEP_UP_S if keep else 0))
        except Exception as exc:  # a node that never started or is gone: its processes went with its actor
            print(f"stepmill: {name}: {str(exc).strip().splitlines()[0]}", file=sys.stderr, flush=True)
    for actor in actors.values():
        ray.kill(actor)  # the actor's process, and with it any child its stop missed (they die with their parent)


class NodeWatch:
    """Each node's proxy as its actor last said: up (in its generation), down (being restarted) or lost.
    A run whose node's proxy died while it ran (the generation changed, or the proxy is down as it ends)
    was cut: some of its calls may never have been committed."""

    def __init__(self, actors: dict):
        self.actors = actors
        self.state = {name: {"state": "up", "generation": 0, "lost": None} for name in actors}

    def refresh(self) -> None:
        import ray

        asked = {name: actor.health.remote() for name, actor in self.actors.items()
                 if self.state[name]["state"] != "lost"}
        for name, answer in asked.items():
            try:
                self.state[name] = ray.get(answer, timeout=30)
            except Exception as exc:  # the actor itself is gone (its Ray node died): nothing runs there again
                self.state[name] = {"state": "lost", "generation": -1, "lost": f"its actor is gone ({type(exc).__name__})"}

    def up(self, name: str) -> bool:
        return self.state[name]["state"] == "up"

    def generation(self, name: str) -> int:
        return self.state[name]["generation"]

    def cut(self, name: str, generation: int) -> bool:
        return not self.up(name) or self.state[name]["generation"] != generation

    def lost(self) -> dict[str, str]:
        return {name: s["lost"] for name, s in self.state.items() if s["state"] == "lost"}


def _drive(config: Config, mode: str, progress: bool, fleet, coordinator_url: str | None, actors: dict) -> Report:
    import ray

    report = Report(isolation=mode)
    wheres = _start_nodes(config, coordinator_url, actors)
    report.nodes = {name: {"db": w.db, "proxy": w.proxy_url, "serve": w.serve_url} for name, w in wheres.items()}
    for name, w in wheres.items():
        print(f"stepmill: {name}: proxy {w.proxy_url}, serve {w.serve_url}, steps in {w.db}", file=sys.stderr,
              flush=True)
    rollout = Rollout(config, mode, fleet, actors, wheres, report)
    try:
        rollout.go(progress)
    except BaseException:
        report.interrupted = True
        _cancel(list(rollout.running))
        raise
    finally:
        report.running = len(rollout.running) if not report.interrupted else 0
        if progress:
            try:
                print_progress(report, rollout.totals, end="\n")
            except Exception:
                pass
    for name, (count, failed) in rollout.rewards.items():
        print(f"reward {name}: scored {count}, failed {failed}", file=sys.stderr)
    if rollout.reruns:
        print(f"stepmill: {rollout.reruns} run(s) ran again after their node's proxy died", file=sys.stderr)
    return report


class Rollout:
    """One Ray rollout's runs: placed, registered, submitted to their nodes, run again where cut, scored."""

    def __init__(self, config: Config, mode: str, fleet, actors: dict, wheres: dict[str, Where], report: Report):
        import ray

        self.config, self.mode, self.fleet, self.actors, self.wheres, self.report = \
            config, mode, fleet, actors, wheres, report
        self.names = list(actors)
        jobs = plan(config)
        report.total = len(jobs)
        ids = [job.trajectory for job in jobs]
        found = dict(zip(self.names, ray.get([actors[name].statuses.remote(ids) for name in self.names])))
        self.placed = place(jobs, self.names, found)
        complete = {t for statuses in found.values() for t, status in statuses.items() if status == "complete"}
        todo = [job for job in jobs if job.trajectory not in complete]
        report.skipped = len(jobs) - len(todo)
        self.by_group: dict[str, list[Job]] = {}
        for job in jobs:
            self.by_group.setdefault(job.group, []).append(job)
        self._register_with_fleet(complete)
        self.queues = {name: collections.deque(job for job in todo if self.placed[job.group] == name)
                       for name in self.names}
        self.secrets: dict[str, str] = {}
        for name, secrets in zip(self.names, ray.get([actors[name].register.remote(list(self.queues[name]))
                                                      for name in self.names])):
            self.secrets.update(secrets)
        self.specs = []
        if config.rewards:
            from stepmill.rewards.scoring import reward_specs

            self.specs = reward_specs(config.tables, config.path, other_sections=True)
        self.rewards: dict[str, list[int]] = {spec.name: [0, 0] for spec in self.specs}
        self.left = {group: sum(job.trajectory not in complete for job in members)
                     for group, members in self.by_group.items()}
        self.scoring: dict = {}  # score task -> group
        self.running: dict = {}  # task -> (node, job, slot, the node's proxy generation at the start)
        per_node = config.run.runs_per_node or config.run.concurrency
        self.free = {name: list(range(per_node)) for name in self.names}  # user mode: a node's uids in use
        self.again: set[str] = set()  # runs to register anew before they run again (a new secret)
        self.attempts: collections.Counter = collections.Counter()
        self.reruns = 0
        self.watch = NodeWatch(actors)
        self.moved: set[str] = set()  # lost nodes whose groups went elsewhere
        self.task = ray.remote(num_cpus=0, max_retries=0)(run_on_node)

    def _register_with_fleet(self, complete: set[str]) -> None:
        """The registry first: every run is known on its node before any starts."""
        if self.fleet is None:
            return
        run = self.config.run
        for group, members in self.by_group.items():
            self.fleet.register_group(group, len(members), channel=run.channel)
            for job in members:
                self.fleet.register_run(job.trajectory, group_id=group, node_id=self.placed[group],
                                        policy_version=run.policy_version)
                if job.trajectory in complete:
                    self.fleet.report(job.trajectory, finished=True, committed=True)

    def go(self, progress: bool) -> None:
        import ray

        for group, count in self.left.items():
            if count == 0:  # every run finished earlier: scored again where not yet (scoring skips what it did)
                self.score(group)
        self.submit()
        while self.running or self.scoring or any(self.queues.values()):
            waiting = [*self.running, *self.scoring]
            ready = []
            if waiting:
                ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            else:  # runs queued on a node whose proxy is being restarted
                time.sleep(1.0)
            self.watch.refresh()
            self.move_from_lost()
            for ref in ready:
                if ref in self.scoring:
                    self.scored(self.scoring.pop(ref), ray.get(ref))
                else:
                    self.finished(ref)
            self.submit()
            self.report.running = len(self.running)
            if progress:
                print_progress(self.report, self.totals)
            if not self.running and not self.scoring and not any(self.up_with_work()):
                self.give_up_waiting()

    def up_with_work(self) -> list[str]:
        return [name for name in self.names if self.queues[name] and not self.watch.lost().get(name)]

    def give_up_waiting(self) -> None:
        """Runs queued on nodes that are all lost (no node left to move them to): failed, left open."""
        for name in self.names:
            while self.queues[name]:
                job = self.queues[name].popleft()
                print(f"stepmill: run {job.trajectory} has no node left to run on; it stays open and runs again "
                      "when the rollout is resumed", file=sys.stderr, flush=True)
                self.report.failed += 1

    def submit(self) -> None:
        """Queued runs onto their nodes' free slots, where the node's proxy is up (a rerun registered anew)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for name in self.names:
            while self.free[name] and self.queues[name] and self.watch.up(name):
                job = self.queues[name][0]
                if job.trajectory in self.again:
                    try:  # a fresh secret; what the cut attempt wrote is labelled bad (``register``)
                        self.secrets.update(ray.get(self.actors[name].register.remote([job]), timeout=60))
                    except Exception as exc:  # its proxy went down again: the next pass tries again
                        print(f"stepmill: run {job.trajectory} not registered again on {name} yet: "
                              f"{str(exc).strip().splitlines()[-1]}", file=sys.stderr, flush=True)
                        break
                    self.again.discard(job.trajectory)
                self.queues[name].popleft()
                slot = self.free[name].pop(0)
                ref = self.task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                    self.wheres[name].ray_node_id, soft=False)).remote(self.config, self.wheres[name], self.mode,
                                                                       job, self.secrets[job.trajectory])
                self.running[ref] = (name, job, slot, self.watch.generation(name))

    def finished(self, ref) -> None:
        """A run's task ended: counted, run again where its node's proxy died under it, or its group scored."""
        import ray

        name, job, slot, generation = self.running.pop(ref)
        self.free[name].append(slot)
        outcome, lost_how = None, None
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayError as exc:  # its worker died (memory, a lost node, its proxy gone)
            lost_how = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        if self.placed[job.group] != name:  # its group moved off a lost node: it runs there
            self.requeue(job)
            return
        if self.watch.cut(name, generation) or lost_how:
            self.cut(name, job, lost_how or "its node's proxy died while it ran")
            return
        if outcome is None:
            return
        self.report.count(outcome)
        if self.fleet is not None:
            self.fleet.report(job.trajectory, finished=True, committed=outcome.committed)
        self.left[job.group] -= 1
        if self.left[job.group] == 0:
            self.score(job.group)

    def cut(self, name: str, job: Job, reason: str) -> None:
        """A run cut under it: again, on its group's node, while ``[run] retries`` allows; else failed and open."""
        if self.attempts[job.trajectory] >= self.config.run.retries:
            print(f"stepmill: run {job.trajectory} on {name} was cut ({reason}) {self.attempts[job.trajectory] + 1} "
                  "time(s); it stays open and runs again when the rollout is resumed", file=sys.stderr, flush=True)
            self.report.failed += 1
            return
        self.attempts[job.trajectory] += 1
        self.reruns += 1
        print(f"stepmill: run {job.trajectory} on {name} was cut ({reason}); it runs again "
              f"(retry {self.attempts[job.trajectory]} of {self.config.run.retries})", file=sys.stderr, flush=True)
        self.event(name, "rerun", f"retry {self.attempts[job.trajectory]} of {self.config.run.retries}: {reason}",
                   run_id=job.trajectory)
        self.requeue(job)

    def requeue(self, job: Job) -> None:
        self.again.add(job.trajectory)
        self.queues[self.placed[job.group]].appendleft(job)

    def move_from_lost(self) -> None:
        """The groups of a lost node that still have runs to make move, whole, to the live node with the
        fewest runs queued; every run of theirs runs there (the lost node's file keeps what it had)."""
        for name, why in self.watch.lost().items():
            if name in self.moved:
                continue
            self.moved.add(name)
            print(f"stepmill: node {name} is lost: {why}", file=sys.stderr, flush=True)
            live = [other for other in self.names if other not in self.watch.lost()]
            groups = [g for g, node in self.placed.items() if node == name and self.left[g] > 0]
            if not live:
                return
            for group in groups:
                target = min(live, key=lambda other: len(self.queues[other]))
                self.move(group, name, target, why)

    def move(self, group: str, lost: str, target: str, why: str) -> None:
        import ray

        running = {job.trajectory for _, job, _, _ in self.running.values()}
        self.placed[group] = target
        self.queues[lost] = collections.deque(job for job in self.queues[lost] if job.group != group)
        members = self.by_group[group]
        self.left[group] = len(members)
        if self.fleet is not None:
            self.fleet.move_group(group, target, f"node {lost} was lost: {why}")
        try:  # what the lost node's file holds of the group is kept out of its readers
            ray.get(self.actors[lost].set_aside.remote([job.trajectory for job in members], target,
                                                       f"its group moved to {target}: {lost} was lost"), timeout=60)
        except Exception as exc:  # its actor is gone with its Ray node: nothing reads that file through it
            print(f"stepmill: {lost}: group {group} not set aside there: {type(exc).__name__}", file=sys.stderr,
                  flush=True)
        for job in members:
            if job.trajectory not in running:  # those still running are queued there when they end
                self.requeue(job)
        print(f"stepmill: group {group} moves from {lost} to {target}", file=sys.stderr, flush=True)

    def event(self, name: str, kind: str, detail: str, run_id: str | None = None) -> None:
        if self.fleet is None:
            return
        try:
            self.fleet.node_event(name, kind, detail, run_id=run_id)
        except Exception as exc:  # the record is for people; the rollout goes on without it
            print(f"stepmill: {name}: event not recorded: {exc}", file=sys.stderr, flush=True)

    def score(self, group: str) -> None:
        if self.specs:
            self.scoring[self.actors[self.placed[group]].score.remote(self.specs, group)] = group
        else:
            self.scored(group, {})

    def scored(self, group: str, result: dict) -> None:
        for name, (count, failed) in result.items():
            self.rewards[name][0] += count
            self.rewards[name][1] += failed
        # A reward that failed on a run leaves its group unscored: not ready, so not handed out half-rewarded.
        if self.fleet is not None and not any(failed for _, failed in result.values()):
            for job in self.by_group[group]:
                self.fleet.report(job.trajectory, scored=True)

    def totals(self) -> dict:
        import ray

        live = [actor for name, actor in self.actors.items() if name not in self.watch.lost()]
        counts = ray.get([actor.totals.remote(f"{self.config.run.dataset}-") for actor in live], timeout=30)
        return {key: sum(c[key] for c in counts) for key in ("steps", "output_tokens")}


def _cancel(refs: list) -> None:
    """Cancel the runs' tasks: each stops its agent's process group; those still going after the grace are killed."""
    import ray

    for ref in refs:
        ray.cancel(ref, force=False)
    deadline = time.monotonic() + CANCEL_GRACE_S
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    for ref in pending:
        ray.cancel(ref, force=True)
