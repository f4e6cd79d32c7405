"""A local Ray cluster of several nodes on this one machine, for `stepmill fleet up` and the tests.

Each node is a `ray start` (the first with ``--head``) whose every port is chosen free and named, so that
several raylets share one machine: Ray's fixed defaults (GCS 6379, dashboard 8265, dashboard agent
52365) would collide. All of them keep their files in one Ray temp folder, which every Ray process of the
cluster names on its command line: that is how `stepmill fleet down` stops this cluster's processes (and
their children, Ray's workers) and no other Ray on the machine, which `ray stop` would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from stepmill.children import free_port

STATE = "ray.json"  # in the fleet folder: the cluster's temp folder, its GCS port, each node's ports
TEMP_PATH_MAX = 40  # Ray's unix sockets lie ~65 bytes under its temp folder, and a socket path has 107
OBJECT_STORE_BYTES = 256 * 1024 * 1024  # per node: the machine's memory is shared by every node here
STOP_GRACE_S = 15.0
NODE_PORTS = ("node_manager", "object_manager", "dashboard_agent_listen", "dashboard_agent_grpc",
              "runtime_env_agent", "metrics_export")


def ray_command() -> list[str]:
    beside = Path(sys.executable).parent / "ray"
    return [str(beside)] if beside.is_file() else [shutil.which("ray") or "ray"]


def temp_folder(fleet_dir: Path) -> Path:
    """Ray's temp folder: ``DIR/ray`` where its sockets' paths fit, else one in /tmp named after DIR."""
    inside = fleet_dir.resolve() / "ray"
    if len(str(inside)) <= TEMP_PATH_MAX:
        return inside
    return Path("/tmp") / f"stepmill-ray-{hashlib.sha256(str(fleet_dir.resolve()).encode()).hexdigest()[:12]}"


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process (zombies left out)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), cmdline)
    return found


def _ray_package() -> tuple[str, ...]:
    """The ray package's folder, as imported and with links resolved (Ray names its programs by either)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if not spec or not spec.submodule_search_locations:
        return ("/ray/",)
    folder = spec.submodule_search_locations[0]
    return folder, os.path.realpath(folder)


def cluster_processes(temp: Path) -> list[int]:
    """The pids of the cluster's processes (Ray's programs naming a path in its temp folder) and of all their
    descendants (Ray's workers, renamed ray::…, and what they started)."""
    table, package = _processes(), _ray_package()
    chosen = {pid for pid, (_, cmdline) in table.items()
              if f"{temp}/" in cmdline and any(folder in cmdline for folder in package)}
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in table.items() if parent in chosen} - chosen
        chosen |= more
        grew = bool(more)
    return sorted(chosen - {os.getpid()})


def head_running(temp: Path) -> bool:
    return any("gcs_server" in cmdline and f"{temp}/" in cmdline for _, cmdline in _processes().values())


def _start_node(temp: Path, cpus: int, log: Path, head_port: int | None) -> dict[str, int]:
    """One `ray start` (the head when ``head_port`` is None): the ports it was given."""
    ports = {name: free_port() for name in NODE_PORTS}
    args = [*ray_command(), "start", "--temp-dir", str(temp), "--num-cpus", str(cpus), "--num-gpus", "0",
            "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
            "--min-worker-port", "0", "--max-worker-port", "0"]  # 0: each worker on a port the OS picks
    args += [f"--{name.replace('_', '-')}-port={port}" for name, port in ports.items()]
    if head_port is None:
        ports |= {"gcs": free_port(), "dashboard": free_port()}
        args += ["--head", f"--port={ports['gcs']}", "--include-dashboard=false", f"--dashboard-port={ports['dashboard']}"]
    else:
        args += [f"--address=127.0.0.1:{head_port}"]
    with log.open("ab") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=300,
                              env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if done.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"`ray start` failed ({done.returncode}); its output, in {log}:\n{tail}")
    return ports


def alive_nodes(address: str, timeout: float = 120.0, want: int = 0) -> list[dict]:
    """The cluster's alive nodes, as ``ray.nodes()`` lists them (waiting up to ``timeout`` for ``want``)."""
    import logging

    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    try:
        deadline = time.monotonic() + timeout
        while True:
            alive = [node for node in ray.nodes() if node.get("Alive")]
            if len(alive) >= want or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)
    finally:
        ray.shutdown()


def ray_up(fleet_dir: Path, nodes: int, cpus: int) -> tuple[dict, bool]:
    """The folder's Ray cluster with at least ``nodes`` alive nodes: reused where its head runs (nodes
    missing added), else started afresh. (its state: temp folder, GCS address, each node's ports; whether
    its head was running already)."""
    state_file = fleet_dir / STATE
    temp = temp_folder(fleet_dir)
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    reused = bool(state) and head_running(temp)
    if not reused:
        stop_processes(cluster_processes(temp))  # what is left of an earlier cluster of this folder
        state = {"temp_dir": str(temp), "nodes": []}
        state["nodes"].append(_start_node(temp, cpus, fleet_dir / "ray-start-1.log", None))
        state["address"] = f"127.0.0.1:{state['nodes'][0]['gcs']}"
    state_file.write_text(json.dumps(state, indent=2))
    alive = len(alive_nodes(state["address"], timeout=10))
    for _ in range(nodes - alive):
        state["nodes"].append(_start_node(temp, cpus, fleet_dir / f"ray-start-{len(state['nodes']) + 1}.log",
                                          state["nodes"][0]["gcs"]))
        state_file.write_text(json.dumps(state, indent=2))
    alive = len(alive_nodes(state["address"], want=nodes))
    if alive < nodes:
        raise RuntimeError(f"Ray lists {alive} alive nodes of {nodes} after 120 s; Ray's logs: "
                           f"{temp}/session_latest/logs")
    state["alive"] = alive
    return state, reused


def stop_processes(pids: list[int]) -> None:
    """SIGTERM to each, then SIGKILL to those still there after ``STOP_GRACE_S`` (as `ray stop` does)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while pids and time.monotonic() < deadline:
            table = _processes()
            pids = [pid for pid in pids if pid in table]
            time.sleep(0.2)
        if not pids:
            return


def ray_down(fleet_dir: Path) -> int:
    """The folder's Ray cluster stopped: how many processes were."""
    pids = cluster_processes(temp_folder(fleet_dir))
    stop_processes(pids)
    return len(pids)
