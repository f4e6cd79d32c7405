"""How the rollout runner keeps each agent run away from everything that could change its own data.

The agents we record are the policies being trained, and they run shell commands: whatever a run
can reach, a policy will eventually use to reach its reward. ``[isolation] mode`` chooses how runs
are kept apart (the README's threat model says what each one stops):

- ``sandbox``: bubblewrap (``bwrap``). Its own PID namespace (no other process's
  ``/proc/*/environ``), no capabilities, the whole file system read-only, ``/tmp`` empty but for
  its own run folder, and the proxy's confdir, the database and its journals, the dataset file and
  the rollout configuration hidden. The network is left as it is: the proxy must be reachable.
- ``user``: another OS user per concurrent run (uids ``first_uid``, ``first_uid + 1``, …; the runner
  must be root). Files stepmill creates are owner-only, so the run reads none of them; a dataset
  file other users can read is refused.
- ``container``: ``prefix`` (a container command, e.g. ``docker run --rm -i --network host …``) runs
  before the agent's command; ``{workdir}``, ``{env_file}`` and ``{uid}`` are filled in.
- ``none``: the agent runs as the runner does and can read and change its own data; every run says so.
- ``auto`` (the default): ``sandbox`` where bubblewrap works, else ``none``.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import stepmill
from stepmill.errors import ConfigError

MODES = ("auto", "sandbox", "user", "container", "none")
# Sockets of services that act for the runner's user (or for root) outside the sandbox: the session and
# system buses (systemd runs anything it is asked), SSH and GPG agents, container engines.
HOST_SOCKETS = ("/run/user", "/run/dbus", "/run/docker.sock", "/run/containerd", "/run/podman", "/run/systemd/private")
# Variables that point a process at such a service, or sign as the runner's user.
PRIVATE_ENV = ("DBUS_SESSION_BUS_ADDRESS", "DBUS_SYSTEM_BUS_ADDRESS", "SSH_AUTH_SOCK", "GPG_AGENT_INFO",
               "XDG_RUNTIME_DIR", "DOCKER_HOST", "CONTAINER_HOST", "DATASETTE_SECRET", "RAY_ADDRESS", "KRB5CCNAME",
               "DATABASE_URL")
# stepmill's own settings (the coordinator's URL among them); Ray's (a run's task inherits its worker's:
# the cluster's address, session, node); PostgreSQL's client settings (a password, a service file).
PRIVATE_PREFIXES = ("STEPMILL_", "RAY_", "PG")
NONE_WARNING = ("stepmill: run {trajectory} is NOT isolated (isolation = none): the agent can read the "
                "database, the dataset's answers and the proxy's token, and change its own data")


class IsolationError(ConfigError):
    """The isolation asked for cannot be had here; the message says why and what to do."""


@dataclass
class Isolation:
    mode: str = "auto"
    first_uid: int = 61000  # user mode: the uids of concurrent runs start here
    prefix: list = field(default_factory=list)  # container mode


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox a run here, or None when it can (tried once, for real)."""
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap is not installed (Debian: apt-get install bubblewrap)"
    try:
        result = subprocess.run([path, *_base_args(), "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run: {exc}"
    if result.returncode != 0:
        return f"bwrap fails here: {result.stderr.decode(errors='replace').strip()[:300]}"
    return None


def _base_args() -> list[str]:
    args = ["--die-with-parent", "--unshare-pid", "--unshare-ipc", "--new-session",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    if os.geteuid() == 0:
        args += ["--cap-drop", "ALL"]  # root in the sandbox must not remount what hides the runner's files
    return args


def resolve(isolation: Isolation) -> str:
    """The mode runs will use; IsolationError when the one asked for cannot be had."""
    mode = isolation.mode
    if mode == "auto":
        return "sandbox" if bwrap_problem() is None else "none"
    if mode == "sandbox" and bwrap_problem() is not None:
        raise IsolationError(f"isolation = sandbox: {bwrap_problem()}")
    if mode == "user" and os.geteuid() != 0:
        raise IsolationError("isolation = user: the runner must run as root to start runs as other users")
    if mode == "container" and not isolation.prefix:
        raise IsolationError("isolation = container needs prefix, the container command to run agents in")
    return mode


@dataclass
class Private:
    """What no run may see: the runner's files and every other run's folder."""

    folders: list[Path]  # hidden whole (confdir, journals, the runs' root)
    files: list[Path]  # hidden one by one (database, its WAL, dataset, configuration)

    @classmethod
    def of(cls, *, db: str, confdir: str, dataset: str, config: str | None, runs_root: Path) -> "Private":
        db_path = Path(db).resolve()
        folders = [Path(confdir).expanduser().resolve(), Path(f"{db_path}.journal"), runs_root.resolve()]
        files = [db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm"), Path(dataset).resolve()]
        if config:
            files.append(Path(config).resolve())
        keeps = [*code_paths(), Path(sys.executable).resolve(), runs_root.resolve()]
        # Whole folders where they hold nothing a run needs: other copies and later files go with them.
        for folder in (db_path.parent, Path(dataset).resolve().parent):
            if not any(_within(keep, folder) for keep in keeps):
                folders.append(folder)
        # A checkout's history holds every version of its files (a bundled dataset's answers too).
        folders += [path / ".git" for path in code_paths() if (path / ".git").is_dir()]
        return cls(folders, files)


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_user_mode(dataset: str) -> None:
    """In user mode a run reads whatever other users may: a dataset readable by them gives answers away."""
    mode = os.stat(dataset).st_mode
    if mode & (stat.S_IROTH | stat.S_IRGRP):
        raise IsolationError(f"isolation = user: the dataset {dataset} is readable by other users, agents "
                             f"included (its answers too): chmod go-r it, or copy it to a private file")


def code_paths() -> list[Path]:
    """What runs need to start at all: the interpreter, its environment and stepmill's own code."""
    # The folder that holds the stepmill package: in a checkout that is the project, addon/ and store/ too.
    package = Path(stepmill.__file__).resolve().parent
    return sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), package.parent})


def sandbox_command(command: list[str], *, run_dir: Path, private: Private, needs: list[Path] = ()) -> list[str]:
    """bubblewrap around ``command``: the run sees its own folder and nothing of the runner's.
    Mounts apply in order: an empty /tmp; what the run needs that lives under /tmp (stepmill's code,
    a tokenizer, the files its command names) back where it was, read-only; the private folders and
    files hidden; last, its own folder, writable."""
    tmp = Path("/tmp")
    args = ["bwrap", *_base_args(), "--tmpfs", "/tmp"]
    wanted = [*code_paths(), *needs, *(Path(part) for part in command if part.startswith("/tmp/"))]
    rebound = sorted({path.resolve() for path in wanted if _within(path.resolve(), tmp) and path.exists()} - {tmp})
    for path in rebound:
        args += ["--ro-bind", str(path), str(path)]

    def visible(path: Path) -> bool:  # everything under /tmp is gone unless it came back above
        return not _within(path, tmp) or any(_within(path, back) for back in rebound)

    for folder in private.folders:
        if folder.is_dir() and visible(folder):
            args += ["--tmpfs", str(folder)]
    for socket in map(Path, HOST_SOCKETS):
        if socket.is_dir():
            args += ["--tmpfs", str(socket)]
        elif socket.exists():
            args += ["--ro-bind", "/dev/null", str(socket)]
    for file in private.files:
        if file.exists() and visible(file):
            args += ["--ro-bind", "/dev/null", str(file)]
    args += ["--bind", str(run_dir), str(run_dir), "--chdir", str(run_dir / "work"), "--"]
    return args + command


def agent_environment(environ: dict) -> dict:
    """What of the runner's environment a run inherits: not stepmill's own settings, nor anything that
    reaches a service acting for the runner's user."""
    return {k: v for k, v in environ.items() if not k.startswith(PRIVATE_PREFIXES) and k not in PRIVATE_ENV}


def container_command(command: list[str], prefix: list[str], *, workdir: Path, env_file: Path, uid: int) -> list[str]:
    values = {"{workdir}": str(workdir), "{env_file}": str(env_file), "{uid}": str(uid)}
    filled = []
    for part in prefix:
        for key, value in values.items():
            part = part.replace(key, value)
        filled.append(part)
    return filled + command


def write_env_file(path: Path, env: dict) -> None:
    """KEY=VALUE lines, as ``docker run --env-file`` and ``podman run --env-file`` read them."""
    lines = [f"{key}={value}" for key, value in env.items() if "\n" not in value and "=" not in key]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def become(uid: int):
    """A ``preexec_fn`` part for user mode: the run's own uid and gid, no supplementary groups."""
    def switch():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return switch


def end_all(uid: int) -> None:
    """Kill every process of ``uid``: what a run left behind (a daemon in its own session) would
    otherwise meet the next run of the same uid. A child that becomes ``uid`` signals all it may
    (kill(-1) spares the caller), then exits."""
    def kill_as_uid():
        become(uid)()
        os.kill(-1, signal.SIGKILL)

    subprocess.run(["/bin/true"], preexec_fn=kill_as_uid, check=False)


def give_to(path: Path, uid: int) -> None:
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, uid)
        for name in files:
            os.chown(os.path.join(root, name), uid, uid)
