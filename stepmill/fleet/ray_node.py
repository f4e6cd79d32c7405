"""A node of a Ray rollout, on the Ray node it is pinned to: its proxy and database, its `stepmill serve`,
its heartbeats to the fleet's coordinator, and the Ray task that makes one run there.

``Node`` is the body of a Ray actor (``ray_rollout.py`` wraps it): it starts the node's `stepmill
proxy` on a SQLite file in ``node_dir`` — a folder on the node's local disk: SQLite's WAL needs a
local filesystem (NFS and other network filesystems break its shared-memory locking) — and `stepmill
serve` on the same file for trainers, registers and scores the runs placed on it, and stops both when
the rollout ends. ``run_on_node`` is a run's Ray task: the same code as a local run (``agent_run.py``),
against the node's proxy, in a run folder of the node's.

Supervision. A thread of the actor watches both processes: one that exits is started again with the
same command (same ports, same file: the runs' tasks keep their addresses; the runs' secrets and the
policy version are in the file). A proxy's death bumps ``generation`` (the runner reruns the runs it
cut); a proxy that does not answer after ``RESTART_TRIES`` starts leaves the node ``lost``. Each is a
node event in the coordinator. The serve's log is ``<node_dir>/<node>.serve.log``.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from stepmill.children import die_with_parent, free_port, wait_up
from stepmill.private_files import private_opener
from stepmill.runner.agent_run import Job, Outcome, RunSite, register, run_one, white_box_tokenizer
from stepmill.runner.config import Config
from stepmill.runner.isolation import UidLeases
from stepmill.runner.proxy_env import ensure_bundle
from stepmill.runner.proxy_handle import ProxyHandle, stop_process
from stepmill.runner.run_folders import new_runs_root, runs_folder

HEARTBEAT_S = 10.0
RESTART_TRIES = 3  # starts of a dead proxy before its node is lost


@dataclass(frozen=True)
class Where:
    """What a run's task needs of its node: the proxy's addresses, its files, the runs' folder."""

    name: str
    db: str
    confdir: str
    proxy_url: str
    reverse_url: str | None
    serve_url: str
    runs_root: str
    bundle: str
    ray_node_id: str | None  # the Ray node the node's actor runs on: its runs' tasks are pinned there


class Node:
    """One node of the rollout (one per Ray node it uses): started by the runner, stopped by it."""

    def __init__(self, name: str, config: Config, node_dir: str, coordinator: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S):
        self.name, self.config = name, config
        self._stopped = threading.Event()
        self._spawning = threading.Lock()  # a restart never starts a process once stop has begun
        self._fleet = None
        self.generation = 0  # how often the node's proxy died: a run that saw it change was cut
        self.lost: str | None = None  # why the proxy could not be restarted: the node takes no more runs
        folder = Path(os.path.expanduser(node_dir))
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.folder = folder
        self._coordinator_url = coordinator
        db = str(folder / f"{name}.db")
        from stepmill.store import Store

        Store(db).close()  # the file and its schema made once, before the proxy's workers open it together
        from stepmill.fleet.keep_serving import stop_kept

        stop_kept(str(folder), [name])  # an earlier rollout's kept serving of this file: this rollout serves it now
        # The node's own proxy on its own file; [proxy] confdir and args apply on every node.
        self.proxy = ProxyHandle(replace(config, proxy={k: v for k, v in config.proxy.items()
                                                        if k not in ("url", "db")}), db)
        self.serve = None
        try:
            self.serve_url, self.serve = self._start_serve(db)
            if config.run.policy_version is not None:  # stamped on every step of this node's file
                self._set_policy_version(config.run.policy_version)
            # The node's runs live as a local rollout's do: beside its database (or [run] runs_dir), pruned by age.
            runs_root = new_runs_root(runs_folder(db, config.run.runs_dir), config.run.keep_runs_days)
            self.where = Where(name, db, self.proxy.confdir, self.proxy.url, self.proxy.reverse_url, self.serve_url,
                               str(runs_root), str(ensure_bundle(self.proxy.confdir)), _ray_node_id())
            if coordinator:
                from stepmill.store.fleet_ledger import Coordinator

                self._fleet = Coordinator(coordinator)
                self._fleet.register_node(name, self.serve_url)
                threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True).start()
            # Long-lived: the processes it restarts die with the thread that started them (die_with_parent).
            threading.Thread(target=self._supervise, name=f"stepmill-supervise-{name}", daemon=True).start()
        except BaseException:
            self.stop()
            raise

    def _set_policy_version(self, version: str) -> None:
        # A proxy of several workers answers health from one while another may still be starting.
        for attempt in range(5):
            try:
                self.proxy.client.set_policy_version(version)
                return
            except ConnectionError:
                if attempt == 4:
                    raise
                time.sleep(0.5)

    def _start_serve(self, db: str, port: int | None = None) -> tuple[str, subprocess.Popen]:
        """`stepmill serve` on the node's file, on the node's address: trainers on other machines fetch here.
        Its log is ``<node_dir>/<node>.serve.log`` (appended to: a restart's lines follow)."""
        host = _node_address()
        port = port or free_port()
        log = self.folder / f"{self.name}.serve.log"
        with open(log, "ab", opener=private_opener) as out:
            process = subprocess.Popen([sys.executable, "-m", "stepmill.cli", "serve", "--db", db, "--host", host,
                                        "--port", str(port), "--confdir", self.proxy.confdir],
                                       stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        url = f"http://{host}:{port}"
        wait_up(lambda: urllib.request.urlopen(f"{url}/v1/health", timeout=5).close(), process,
                 f"stepmill serve on node {self.name}", log)
        return url, process

    # --- supervision: the node's proxy and serve, restarted where they die ------------------------------

    def _supervise(self, every: float = 0.5) -> None:
        """Watch the node's proxy and serve as a supervisor watches its workers: one that exits is started
        again on the same ports and files, so the runs' tasks keep their addresses."""
        while not self._stopped.wait(every):
            try:
                if self.lost is None and self.proxy.process.poll() is not None:
                    self._heal_proxy()
                if self.serve.poll() is not None:
                    self._heal_serve()
            except Exception as exc:  # never let the watch end: the next pass looks again
                print(f"stepmill: node {self.name}: supervision: {exc}", file=sys.stderr, flush=True)

    def _heal_proxy(self) -> None:
        """The proxy died: every run in flight is cut (``generation`` changes); up to ``RESTART_TRIES``
        starts of the same command, else the node is lost."""
        self.generation += 1
        died = self.proxy.process
        self._event("proxy_died", f"exit {died.returncode}; the runs in flight on it are cut and run again")
        reason = ""
        # A short wait per probe: something else listening on the port (it was taken) never answers.
        probe = copy.copy(self.proxy.client)
        probe.timeout = 5
        for attempt in range(1, RESTART_TRIES + 1):
            time.sleep(attempt - 1)  # a port the dead process held may take a moment to be free
            try:
                self.proxy.process = self._respawn(died.args, Path(self.proxy.log))
                if self.proxy.process is None:
                    return  # the node is stopping
                wait_up(probe.health, self.proxy.process, f"the proxy of node {self.name}",
                         self.proxy.log)
                self._event("proxy_restarted", f"pid {self.proxy.process.pid}, attempt {attempt} of "
                                               f"{RESTART_TRIES}, at {self.proxy.url} on {self.proxy.db}")
                return
            except (OSError, RuntimeError) as exc:
                reason = str(exc)
        self.lost = f"its proxy died and did not come back after {RESTART_TRIES} starts ({reason})"
        self._event("proxy_lost", self.lost)

    def _heal_serve(self) -> None:
        died = self.serve
        self._event("serve_died", f"exit {died.returncode}")
        port = int(self.serve_url.rsplit(":", 1)[1])
        with self._spawning:
            if self._stopped.is_set():
                return
        try:
            self.serve_url, self.serve = self._start_serve(self.proxy.db, port)
            self._event("serve_restarted", f"pid {self.serve.pid} at {self.serve_url}")
        except (OSError, RuntimeError) as exc:
            print(f"stepmill: node {self.name}: {exc}; trying again", file=sys.stderr, flush=True)

    def _respawn(self, command: list, log: Path) -> subprocess.Popen | None:
        """The same command again (its ports and files in it), its output after the first's; None once stopping."""
        with self._spawning, open(log, "ab", opener=private_opener) as out:
            if self._stopped.is_set():
                return None
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def _event(self, kind: str, detail: str) -> None:
        """Said on the node's log and recorded with the coordinator (a coordinator away: said only)."""
        print(f"stepmill: node {self.name}: {kind.replace('_', ' ')}: {detail}", file=sys.stderr, flush=True)
        if self._fleet is not None:
            try:
                self._fleet.node_event(self.name, kind, detail)
            except Exception as exc:
                print(f"stepmill: node {self.name}: event not recorded: {exc}", file=sys.stderr, flush=True)

    def health(self) -> dict:
        """The proxy as the runner sees it: up, down (being restarted) or lost, and its generation."""
        down = self.proxy.process is not None and self.proxy.process.poll() is not None
        state = "lost" if self.lost else "down" if down else "up"
        return {"state": state, "generation": self.generation, "lost": self.lost}

    def _heartbeat(self, every: float) -> None:
        while not self._stopped.wait(every):
            try:
                self._fleet.heartbeat(self.name)
            except Exception as exc:  # the coordinator away for a while: the next beat tries again
                print(f"stepmill: node {self.name}: heartbeat failed: {exc}", file=sys.stderr, flush=True)

    def info(self) -> Where:
        return self.where

    def statuses(self, trajectories: list[str]) -> dict[str, str]:
        """The status of each trajectory this node's file holds (the others are absent)."""
        from stepmill.store import Store

        store = Store(self.proxy.db, readonly=True)
        try:
            found = {t: store.trajectory(t) for t in trajectories}
            # A run set aside here (its group moved off this node when it was lost) is another node's now.
            return {t: row["status"] for t, row in found.items() if row and not (row["metadata"] or {}).get("moved_to")}
        finally:
            store.close()

    def register(self, jobs: list[Job]) -> dict[str, str]:
        """Every run placed here registered with the node's proxy before any starts: trajectory -> secret."""
        from stepmill.store import Store

        store = Store(self.proxy.db, readonly=True)
        try:
            return {job.trajectory: register(self.config, self.proxy.client, store, job) for job in jobs}
        finally:
            store.close()

    def score(self, specs: list, group: str) -> dict[str, tuple[int, int]]:
        """The rewards of a group whose runs all finished here, against this node's file: name -> (scored, failed)."""
        from stepmill.rewards.scoring import score
        from stepmill.store import Store

        store = Store(self.proxy.db)
        try:
            reports = score(store, specs, group_id=group, progress=False)
            return {name: (r.scored, r.failed) for name, r in reports.items()}
        finally:
            store.close()

    def set_aside(self, trajectories: list[str], target: str, why: str) -> int:
        """Runs whose group moved to ``target`` (this node was lost): labelled bad in this file, so the gate
        keeps them out of every reader of it (Ray Data, a serve), and marked moved, so a resumed rollout
        places them on ``target``, where the coordinator has them."""
        from stepmill.store import Store

        store = Store(self.proxy.db)
        try:
            present = [t for t in trajectories if store.trajectory(t) is not None]
            for trajectory in present:
                store.update_trajectory(trajectory, metadata={"moved_to": target})
                store.add_review(trajectory, "label", "bad", reviewer="stepmill-rollout")
                store.add_review(trajectory, "note", why, reviewer="stepmill-rollout")
            return len(present)
        finally:
            store.close()

    def totals(self, id_prefix: str) -> dict:
        from stepmill.store import Store

        store = Store(self.proxy.db, readonly=True)
        try:
            return store.rollout_totals(id_prefix)
        finally:
            store.close()

    def stop(self, keep: bool = False) -> None:
        """The node's proxy and serve stop (what they committed stays in the file); heartbeats and the
        supervision end. ``keep`` (``[run] serve = "keep"``, a rollout that ended): the file is served on
        by a process of its own until its groups are consumed (``keep_serving.keep_after_rollout``)."""
        with self._spawning:
            self._stopped.set()
        stop_process(self.serve, 15)
        if getattr(self, "proxy", None) is not None:
            self.proxy.close()
        if self._fleet is not None:
            if self.serve is not None:
                self._event("serve_stopped", f"{self.serve_url}: the rollout ended")
                if keep and self.lost is None:
                    self._keep_serving()
            self._fleet.close()

    def _keep_serving(self) -> None:
        from stepmill.fleet.keep_serving import keep_after_rollout

        try:
            pid = keep_after_rollout(self.name, str(self.folder), self.proxy.confdir, self._coordinator_url)
        except Exception as exc:  # the rollout ends all the same; `stepmill fleet serve` can serve the file
            self._event("serve_not_kept", f"{type(exc).__name__}: {exc}")
            return
        self._event("serve_kept", f"until its groups are consumed (pid {pid}; log {self.folder}/{self.name}.keep.log;"
                                  " `stepmill fleet serve --stop` ends it)")


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # not in Ray (a node made by hand, in a test)
        return None


def _node_address() -> str:
    """This node's address as the cluster knows it (Ray's view), else the host's."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def run_on_node(config: Config, where: Where, mode: str, job: Job, secret: str) -> Outcome | None:
    """A run's Ray task, on its node: exactly a local run, through the node's proxy. Cancelling the task
    (the runner's Ctrl-C) stops the run's process group; its trajectory stays open for a resume."""
    proxy = ProxyHandle.reached(url=where.proxy_url, reverse_url=where.reverse_url, confdir=where.confdir,
                                db=where.db)
    # The run's uid is leased on its machine: runs of other nodes there, or of other rollouts, never share it.
    site = RunSite(config, proxy, mode, Path(where.runs_root), Path(where.bundle),
                   UidLeases(config.isolation.first_uid), white_box_tokenizer(config))
    try:
        return run_one(site, job, secret)
    except BaseException:  # KeyboardInterrupt or Ray's cancellation
        site.stop_all()
        raise
