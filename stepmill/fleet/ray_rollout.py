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
    started_ray = not ray.is_initialized()
    if started_ray:
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=run.ray_address, log_to_driver=True, configure_logging=False)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():  # the command's own Ctrl-C handling, not Ray's exit
                signal.signal(sig, handler)
    coordinator_url = run.coordinator or os.environ.get("STEPMILL_COORDINATOR") or None
    fleet = None
    actors: dict[str, object] = {}
    try:
        if coordinator_url:
            from stepmill.store.fleet_ledger import Coordinator

            fleet = Coordinator(coordinator_url)
        return _drive(config, mode, progress, fleet, coordinator_url, actors)
    finally:
        _stop_nodes(actors)
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
            num_cpus=0, max_concurrency=4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(name, config, config.run.node_dir, coordinator_url)
    wheres = ray.get([actor.info.remote() for actor in actors.values()])
    return dict(zip(actors, wheres))


def _stop_nodes(actors: dict) -> None:
    import ray

    stops = {name: actor.stop.remote() for name, actor in actors.items()}  # all at once, each waited for
    for name, stop in stops.items():
        try:
            ray.get(stop, timeout=STOP_NODE_S)
        except Exception as exc:  # a node that never started or is gone: its processes went with its actor
            print(f"stepmill: {name}: {str(exc).strip().splitlines()[0]}", file=sys.stderr, flush=True)
    for actor in actors.values():
        ray.kill(actor)  # the actor's process, and with it any child its stop missed (they die with their parent)


def _drive(config: Config, mode: str, progress: bool, fleet, coordinator_url: str | None, actors: dict) -> Report:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    run = config.run
    report = Report(isolation=mode)
    wheres = _start_nodes(config, coordinator_url, actors)
    report.nodes = {name: {"db": w.db, "proxy": w.proxy_url, "serve": w.serve_url} for name, w in wheres.items()}
    for name, w in wheres.items():
        print(f"stepmill: {name}: proxy {w.proxy_url}, serve {w.serve_url}, steps in {w.db}", file=sys.stderr,
              flush=True)
    names = list(actors)
    jobs = plan(config)
    report.total = len(jobs)
    ids = [job.trajectory for job in jobs]
    found = dict(zip(names, ray.get([actors[name].statuses.remote(ids) for name in names])))
    placed = place(jobs, names, found)
    complete = {t for statuses in found.values() for t, status in statuses.items() if status == "complete"}
    todo = [job for job in jobs if job.trajectory not in complete]
    report.skipped = len(jobs) - len(todo)
    by_group: dict[str, list[Job]] = {}
    for job in jobs:
        by_group.setdefault(job.group, []).append(job)
    if fleet is not None:  # the registry first: every run is known on its node before any starts
        for group, members in by_group.items():
            fleet.register_group(group, len(members), channel=run.channel)
            for job in members:
                fleet.register_run(job.trajectory, group_id=group, node_id=placed[group],
                                   policy_version=run.policy_version)
                if job.trajectory in complete:
                    fleet.report(job.trajectory, finished=True, committed=True)
    queues = {name: collections.deque(job for job in todo if placed[job.group] == name) for name in names}
    secrets: dict[str, str] = {}
    for name, secret_map in zip(names, ray.get([actors[name].register.remote(list(queues[name])) for name in names])):
        secrets.update(secret_map)

    specs = []
    if config.rewards:
        from stepmill.rewards.scoring import load_config

        specs = load_config(config.path, other_sections=True)
    rewards: dict[str, list[int]] = {spec.name: [0, 0] for spec in specs}
    left = {group: sum(job.trajectory not in complete for job in members) for group, members in by_group.items()}
    scoring: dict = {}  # score task -> group

    def score(group: str) -> None:
        if specs:
            scoring[actors[placed[group]].score.remote(specs, group)] = group
        else:
            scored(group, {})

    def scored(group: str, result: dict) -> None:
        for name, (count, failed) in result.items():
            rewards[name][0] += count
            rewards[name][1] += failed
        # A reward that failed on a run leaves its group unscored: not ready, so not handed out half-rewarded.
        if fleet is not None and not any(failed for _, failed in result.values()):
            for job in by_group[group]:
                fleet.report(job.trajectory, scored=True)

    for group, count in left.items():
        if count == 0:  # every run finished earlier: scored again where not yet (scoring skips what it did)
            score(group)

    task = ray.remote(num_cpus=0, max_retries=0)(run_on_node)
    per_node = run.runs_per_node or run.concurrency
    free = {name: list(range(per_node)) for name in names}  # user mode: a node's uids in use
    running: dict = {}  # task -> (node, job, slot)

    def submit() -> None:
        for name in names:
            while free[name] and queues[name]:
                job, slot = queues[name].popleft(), free[name].pop(0)
                ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                    wheres[name].ray_node_id, soft=False)).remote(config, wheres[name], mode, job,
                                                                  secrets[job.trajectory])
                running[ref] = (name, job, slot)

    def totals() -> dict:
        counts = ray.get([actor.totals.remote(f"{run.dataset}-") for actor in actors.values()], timeout=30)
        return {key: sum(c[key] for c in counts) for key in ("steps", "output_tokens")}

    try:
        submit()
        while running or scoring:
            ready, _ = ray.wait([*running, *scoring], num_returns=1, timeout=1.0)
            for ref in ready:
                if ref in scoring:
                    scored(scoring.pop(ref), ray.get(ref))
                    continue
                name, job, slot = running.pop(ref)
                free[name].append(slot)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayError as exc:  # its worker died (memory, a lost node): one run lost
                    print(f"stepmill: run {job.trajectory} on {name} was lost ({type(exc).__name__}); it stays "
                          "open and runs again when the rollout is resumed", file=sys.stderr, flush=True)
                    report.failed += 1
                    continue
                if outcome is None:
                    continue
                report.count(outcome)
                if fleet is not None:
                    fleet.report(job.trajectory, finished=True, committed=outcome.committed)
                left[job.group] -= 1
                if left[job.group] == 0:
                    score(job.group)
            submit()
            report.running = len(running)
            if progress:
                print_progress(report, totals)
    except BaseException:
        report.interrupted = True
        _cancel(list(running))
        raise
    finally:
        report.running = len(running) if not report.interrupted else 0
        if progress:
            try:
                print_progress(report, totals, end="\n")
            except Exception:
                pass
    for name, (count, failed) in rewards.items():
        print(f"reward {name}: scored {count}, failed {failed}", file=sys.stderr)
    return report


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
