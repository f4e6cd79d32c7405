"""`stepmill fleet serve`: a rollout's node files served after the rollout, for trainers still consuming.

A Ray rollout's nodes stop their `stepmill serve` when the rollout ends. This serves again every node
file of the rollout's ``[run] node_dir`` on this machine (``<node_dir>/<node id>.db``: the file's name
is the node's id), each as the node the coordinator knows: the same id, and the serve URL the
coordinator has for it (its port again where it is free, else a new one, advertised). Each is a
`stepmill serve --node-id` (heartbeats, readiness published), its log appended to
``<node_dir>/<node id>.serve.log``, started again where it dies; all stop on Ctrl-C, or, with
``until_consumed``, once no group with runs on these nodes is waiting, ready or leased.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from stepmill.children import die_with_parent, free_port
from stepmill.fleet.ray_node import wait_up
from stepmill.private_files import private_opener
from stepmill.runner.proxy_handle import stop_process


@dataclass
class Served:
    node_id: str
    command: list
    url: str
    log: Path
    process: subprocess.Popen | None = None


def node_files(node_dir: str) -> dict[str, Path]:
    """node id -> its file, for each node file in ``node_dir``."""
    return {path.stem: path for path in sorted(Path(node_dir).expanduser().glob("*.db"))}


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


def plan_serves(files: dict[str, Path], registered: dict[str, str], confdir: str, coordinator: str) -> list[Served]:
    """A serve for each file whose node the coordinator knows, at the URL it knows where that port is free."""
    served = []
    for node_id, path in files.items():
        parts = urlsplit(registered[node_id])
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        if not _port_free(host, port):
            port = free_port()
        command = [sys.executable, "-m", "stepmill.cli", "serve", "--db", str(path), "--host", host, "--port",
                   str(port), "--confdir", confdir, "--node-id", node_id, "--coordinator", coordinator]
        served.append(Served(node_id, command, f"http://{host}:{port}", path.with_suffix(".serve.log")))
    return served


def start(served: Served) -> None:
    with open(served.log, "ab", opener=private_opener) as out:
        served.process = subprocess.Popen(served.command, stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=die_with_parent)
    wait_up(lambda: urllib.request.urlopen(f"{served.url}/v1/health", timeout=5).close(), served.process,
            f"stepmill serve of node {served.node_id}", served.log)


def keep_serving(fleet, coordinator_url: str, node_dir: str, confdir: str, *, until_consumed: bool,
                 every_s: float = 2.0, say=print) -> int:
    """Serve the node files until Ctrl-C (or until consumed); returns how many nodes were served."""
    files = node_files(node_dir)
    registered = {node["id"]: node["serve_url"] for node in fleet.nodes()}
    for node_id in sorted(set(files) - set(registered)):
        say(f"stepmill fleet serve: {files[node_id]}: no node {node_id!r} in the coordinator; not served")
    files = {node_id: path for node_id, path in files.items() if node_id in registered}
    serves = plan_serves(files, registered, confdir, coordinator_url)
    try:
        for served in serves:
            start(served)
            say(f"stepmill fleet serve: node {served.node_id} at {served.url} (its log: {served.log})")
        while serves:
            for served in serves:
                if served.process.poll() is not None:
                    say(f"stepmill fleet serve: node {served.node_id}: serve exited {served.process.returncode};"
                        " starting it again")
                    start(served)
            if until_consumed and fleet.unconsumed([s.node_id for s in serves]) == 0:
                say(f"stepmill fleet serve: every group of {', '.join(s.node_id for s in serves)} is consumed")
                break
            time.sleep(every_s)
    except KeyboardInterrupt:
        pass
    finally:
        for served in serves:
            stop_process(served.process, 15)
    return len(serves)
