"""`stepmill fleet serve`: a rollout's node files served after the rollout, for trainers still consuming.

A Ray rollout's nodes stop their `stepmill serve` when the rollout ends. This serves again every node
file of the rollout's ``[run] node_dir`` on this machine (``<node_dir>/<node id>.db``: the file's name
is the node's id), each as the node the coordinator knows: the same id, and the serve URL the
coordinator has for it (its port again where it is free, else a new one, advertised). Each is a
`stepmill serve --node-id` (heartbeats, readiness published), its log appended to
``<node_dir>/<node id>.serve.log``, started again where it dies; all stop on Ctrl-C, or, with
``until_consumed``, once no group with runs on these nodes is waiting, ready or leased.

Kept after a rollout. With ``[run] serve = "keep"`` each node, as its rollout ends, hands its file to a
`stepmill fleet serve --node <id> --until-consumed` of its own (``keep_after_rollout``): a process of its
own session that outlives the rollout's actor, whose pid is ``<node_dir>/<node id>.keep.pid`` and whose
log is ``<node_dir>/<node id>.keep.log``; ``stop_kept`` (`stepmill fleet serve --stop`) ends it early.
The coordinator's URL reaches every serve in its environment, never on a command line (it may hold a
password, and command lines are readable by every local user).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from stepmill.children import die_with_parent, free_port, wait_up
from stepmill.errors import StoreUnavailable
from stepmill.private_files import private_opener
from stepmill.runner.proxy_handle import stop_process
from stepmill.store.fleet_ledger import ENV


@dataclass
class Served:
    node_id: str
    command: list
    url: str
    log: Path
    process: subprocess.Popen | None = None


def node_files(node_dir: str, only: list[str] | None = None) -> dict[str, Path]:
    """node id -> its file, for each node file in ``node_dir`` (of the nodes ``only`` names, where given)."""
    return {path.stem: path for path in sorted(Path(node_dir).expanduser().glob("*.db"))
            if not only or path.stem in only}


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


def plan_serves(files: dict[str, Path], registered: dict[str, str], confdir: str) -> list[Served]:
    """A serve for each file whose node the coordinator knows, at the URL it knows where that port is free."""
    served = []
    for node_id, path in files.items():
        parts = urlsplit(registered[node_id])
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        if not _port_free(host, port):
            port = free_port()
        command = [sys.executable, "-m", "stepmill.cli", "serve", "--db", str(path), "--host", host, "--port",
                   str(port), "--confdir", confdir, "--node-id", node_id]  # the coordinator: in its environment
        served.append(Served(node_id, command, f"http://{host}:{port}", path.with_suffix(".serve.log")))
    return served


def start(served: Served, coordinator_url: str) -> None:
    with open(served.log, "ab", opener=private_opener) as out:
        served.process = subprocess.Popen(served.command, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, ENV: coordinator_url}, preexec_fn=die_with_parent)
    wait_up(lambda: urllib.request.urlopen(f"{served.url}/v1/health", timeout=5).close(), served.process,
            f"stepmill serve of node {served.node_id}", served.log)


def _start_or_say(served: Served, coordinator_url: str, say) -> None:
    """A node's serve started (again, where it exited); one that does not come up is tried next pass."""
    if served.process is not None:
        say(f"stepmill fleet serve: node {served.node_id}: serve exited {served.process.returncode}; starting it again")
    try:
        start(served, coordinator_url)
    except RuntimeError as exc:
        say(f"stepmill fleet serve: node {served.node_id}: {exc}; trying again")
        return
    say(f"stepmill fleet serve: node {served.node_id} at {served.url} (its log: {served.log})")


def _consumed(fleet, node_ids: list[str], say) -> bool:
    """Whether no group with runs on these nodes is left to consume (a coordinator away: not yet)."""
    try:
        return fleet.unconsumed(node_ids) == 0
    except StoreUnavailable as exc:
        say(f"stepmill fleet serve: {exc}; asking again")
        return False


def keep_serving(fleet, coordinator_url: str, node_dir: str, confdir: str, *, until_consumed: bool,
                 only: list[str] | None = None, every_s: float = 2.0, say=print) -> int:
    """Serve the node files (``only`` these nodes', where given) until Ctrl-C (or until consumed);
    returns how many nodes were served."""
    files = node_files(node_dir, only)
    registered = {node["id"]: node["serve_url"] for node in fleet.nodes()}
    for node_id in sorted(set(files) - set(registered)):
        say(f"stepmill fleet serve: {files[node_id]}: no node {node_id!r} in the coordinator; not served")
    files = {node_id: path for node_id, path in files.items() if node_id in registered}
    serves = plan_serves(files, registered, confdir)
    try:
        while serves:
            for served in serves:
                if served.process is None or served.process.poll() is not None:
                    _start_or_say(served, coordinator_url, say)
            if until_consumed and _consumed(fleet, [s.node_id for s in serves], say):
                say(f"stepmill fleet serve: every group of {', '.join(s.node_id for s in serves)} is consumed")
                break
            time.sleep(every_s)
    except KeyboardInterrupt:
        pass
    finally:
        for served in serves:
            stop_process(served.process, 15)
    return len(serves)


def keep_pid_file(node_dir: str, node_id: str) -> Path:
    return Path(node_dir).expanduser() / f"{node_id}.keep.pid"


KEEP_UP_S = 90.0  # how long a kept serving may take to answer before the node gives up on it


def keep_after_rollout(node_id: str, node_dir: str, confdir: str, coordinator_url: str,
                       timeout: float = KEEP_UP_S) -> int:
    """The node's file served on, after its rollout, by a `stepmill fleet serve --node <id> --until-consumed`
    of its own session (it outlives the Ray worker that starts it: an intermediate process that exits at
    once leaves it to init, so no worker cleanup reaches it); returns its pid (also in the pid file) once
    it serves. RuntimeError, with its log's last lines, where it ends or does not serve in ``timeout``."""
    folder = Path(node_dir).expanduser()
    log = folder / f"{node_id}.keep.log"
    command = [sys.executable, "-m", "stepmill.cli", "fleet", "serve", "--node-dir", str(folder), "--confdir",
               confdir, "--node", node_id, "--until-consumed"]
    # The intermediate starts the keeper in a new session, says its pid, and exits.
    starter = ("import subprocess, sys\n"
               "log = open(sys.argv[1], 'ab')\n"
               "keeper = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,"
               " start_new_session=True)\n"
               "print(keeper.pid)")
    with open(log, "ab", opener=private_opener) as made:  # private before the keeper appends to it
        offset = made.tell()
    said = subprocess.run([sys.executable, "-c", starter, str(log), *command], capture_output=True, text=True,
                          env={**os.environ, ENV: coordinator_url}, timeout=60, check=True)
    pid = int(said.stdout.strip())
    with open(keep_pid_file(node_dir, node_id), "w", opener=private_opener) as out:
        out.write(f"{pid}\n")
    deadline = time.monotonic() + timeout
    while f"node {node_id} at http".encode() not in _read_from(log, offset):
        if not _is_keeper(pid, node_id) or time.monotonic() > deadline:
            stop_kept(node_dir, [node_id])
            lines = _read_from(log, offset).decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the serving kept for {node_id} did not start: {' / '.join(lines) or 'no output'}")
        time.sleep(0.2)
    return pid


def _read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as log:
        log.seek(offset)
        return log.read()


def _is_keeper(pid: int, node_id: str) -> bool:
    """Whether the pid is still the keeper of this node (not a later process given the same pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"fleet" in argv and b"--node" in argv and node_id.encode() in argv


def stop_kept(node_dir: str, only: list[str] | None = None, timeout: float = 30.0) -> list[str]:
    """The keepers of ``node_dir``'s nodes (``only`` these, where given) stopped (SIGTERM: each stops its
    serves); returns the node ids whose keeper was running."""
    stopped = []
    for pid_file in sorted(Path(node_dir).expanduser().glob("*.keep.pid")):
        node_id = pid_file.name[:-len(".keep.pid")]
        if only and node_id not in only:
            continue
        pid = int(pid_file.read_text().strip() or 0)
        if pid and _is_keeper(pid, node_id):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _is_keeper(pid, node_id) and time.monotonic() < deadline:
                time.sleep(0.2)
            stopped.append(node_id)
        pid_file.unlink(missing_ok=True)
    return stopped
