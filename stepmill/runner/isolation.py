"""How the rollout runner keeps each agent run away from everything that could change its own data.

The agents we record are the policies being trained, and they run shell commands: whatever a run
can reach, a policy will eventually use to reach its reward. ``[isolation] mode`` chooses how runs
are kept apart (the README's threat model says what each one stops):

- ``sandbox``: bubblewrap (``bwrap``). Its own PID namespace (no other process's
  ``/proc/*/environ``), no capabilities, and files by allow-list: the system's read-only trees
  (``/usr``, ``/bin``, ``/lib*``, ``/etc`` less its secrets), the interpreter and stepmill's code,
  the agent's own install folder, what ``[isolation] expose`` names, an empty ``/tmp`` but for its
  own run folder (its work folder, its home, its CA bundle). Nothing else is there: not the
  runner's home, ``/root``, ``/home``, ``/var``, ``/srv``, ``/opt``, ``/mnt``, ``/media``; and
  within what is there, the proxy's confdir, the database and its journals, the dataset file and
  the rollout configuration are hidden.
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
from stepmill.runner.limits import Limits

MODES = ("auto", "sandbox", "user", "container", "none")
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


# What programs need of the system, read-only (a symlink, as /bin on a merged /usr, stays one).
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# What of /etc no run needs and a run could use: password hashes, host and TLS keys, who may sudo,
# databases' client and server settings, stored network and VPN credentials.
ETC_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/security/opasswd",
               "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private", "/etc/pki/tls/private",
               "/etc/postgresql", "/etc/postgresql-common", "/etc/pg_service.conf", "/etc/mysql",
               "/etc/credstore", "/etc/credstore.encrypted", "/etc/wireguard", "/etc/ipsec.secrets",
               "/etc/ppp", "/etc/krb5.keytab", "/etc/docker", "/etc/containers/auth.json", "/etc/letsencrypt",
               "/etc/NetworkManager/system-connections", "/etc/ray")


@dataclass
class Exposed:
    """A path of the host a sandboxed run sees too (``[isolation] expose``), read-only unless writable."""

    path: Path
    writable: bool = False


@dataclass
class Isolation:
    mode: str = "auto"
    first_uid: int = 61000  # user mode: the uids of concurrent runs start here
    prefix: list = field(default_factory=list)  # container mode
    # sandbox: more the runs see: "/path" (read-only) or { path = "/path", writable = true }
    expose: list = field(default_factory=list)
    # sandbox: "own" (a network namespace whose only way out is the run's door to the proxy) or "host"
    network: str = "own"
    # sandbox, network = "own": hosts (host or host:port) a run may reach through the proxy besides LLM
    # calls (the configured LLM's host is always one), e.g. a package index a task needs
    allow_hosts: list = field(default_factory=list)
    # processes, memory, CPU time, file size and output log of each run (limits.py)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        self.expose = [exposed(item) for item in self.expose]
        if isinstance(self.limits, dict):
            unknown = set(self.limits) - set(Limits.__dataclass_fields__)
            if unknown:
                raise ConfigError(f"[isolation] limits: unknown {', '.join(sorted(unknown))}; "
                                  f"known: {', '.join(Limits.__dataclass_fields__)}")
            self.limits = Limits(**self.limits)
        if self.network not in ("own", "host"):
            raise ConfigError(f"[isolation] network must be \"own\" or \"host\", not {self.network!r}")
        if not (isinstance(self.allow_hosts, list) and all(isinstance(h, str) and h for h in self.allow_hosts)):
            raise ConfigError("[isolation] allow_hosts must be a list of host or host:port strings")


def exposed(item) -> Exposed:
    if isinstance(item, Exposed):
        return item
    if isinstance(item, str):
        item = {"path": item}
    if not (isinstance(item, dict) and isinstance(item.get("path"), str) and set(item) <= {"path", "writable"}
            and isinstance(item.get("writable", False), bool)):
        raise ConfigError(f"[isolation] expose: {item!r} is not a path or {{ path = \"/…\", writable = true }}")
    path = Path(os.path.expanduser(item["path"]))
    if not path.is_absolute():
        raise ConfigError(f"[isolation] expose: {item['path']!r} must be an absolute path")
    if not path.exists():
        raise ConfigError(f"[isolation] expose: {item['path']} does not exist")
    return Exposed(path.resolve(), item.get("writable", False))


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
    """A root of nothing (bwrap's empty tmpfs) with the system's trees in it, read-only."""
    args = ["--die-with-parent", "--unshare-pid", "--unshare-ipc", "--new-session"]
    for tree in SYSTEM_TREES:
        if os.path.islink(tree):
            args += ["--symlink", os.readlink(tree), tree]
        elif os.path.isdir(tree):
            args += ["--ro-bind", tree, tree]
    args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
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
        folders += sorted({folder / ".git" for path in code_paths() for folder in (path, *path.parents)
                           if (folder / ".git").is_dir()})
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
    """What runs need to start at all: the interpreter, its environment and stepmill's own code: the
    package's folders alone (in a checkout, not the checkout around them: its tests, notes, builds)."""
    from importlib.util import find_spec

    # Found, not imported: the runner never loads the proxy's or the bridge's code.
    packages = {Path(folder).resolve() for name in ("stepmill", "stepmill.addon", "stepmill.store", "stepmill.trainer_bridge")
                for folder in find_spec(name).submodule_search_locations}
    return sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), *packages})


def install_folders(command: list[str], search_path: str | None) -> list[Path]:
    """Where the agent's program lives: its install folder (a virtual environment, the folder above
    node_modules) and those of the interpreters it runs on (a script's #! line, a venv's home), every
    symlink on the way followed."""
    found: list[Path] = []
    first = command[0] if "/" in command[0] else shutil.which(command[0], path=search_path)
    todo = [part for part in [first, *command[1:]] if part and part.startswith("/") and os.path.exists(part)]
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen or len(seen) > 50:
            continue
        seen.add(path)
        if os.path.islink(path):
            todo.append(os.path.join(os.path.dirname(path), os.readlink(path)))
        found += _install_root(Path(os.path.abspath(path)))
        interpreter = _shebang(path)
        if interpreter:
            todo.append(interpreter if "/" in interpreter else shutil.which(interpreter, path=search_path) or "")
    return found


def module_folders(command: list[str], entry: str | None, pythonpath: str | None) -> list[Path]:
    """Where the Python modules a run starts live (``python -m pkg.mod``'s, a white-box entry's): the
    top package's folder (or the lone module's file), looked up on the agent's PYTHONPATH, then on the
    runner's path. stepmill's own are in ``code_paths`` already."""
    from importlib.machinery import PathFinder

    modules = [entry.partition(":")[0]] if entry else []
    modules += [command[i + 1] for i, part in enumerate(command[:-1]) if part == "-m"]
    search = [p for p in (pythonpath or "").split(os.pathsep) if p] + [p for p in sys.path if p]
    found = []
    for top in {module.partition(".")[0] for module in modules} - {"stepmill"}:
        spec = PathFinder.find_spec(top, search)
        if spec is not None and spec.submodule_search_locations:
            found += [Path(folder) for folder in spec.submodule_search_locations]
        elif spec is not None and spec.origin and os.path.isfile(spec.origin):
            found.append(Path(spec.origin))
    return found


def _install_root(path: Path) -> list[Path]:
    for folder in path.parents:
        config = folder / "pyvenv.cfg"
        if config.is_file():  # a venv, and the Python it was made from
            home = next((line.partition("=")[2].strip() for line in config.read_text(errors="replace").splitlines()
                         if line.partition("=")[0].strip() == "home"), None)
            return [folder] + ([Path(home).resolve().parent] if home and Path(home).name == "bin" else [])
        if folder.name == "node_modules":
            return [folder.parent]
    folder = path.parent if not path.is_dir() else path
    # A program straight in a home folder (or at /) brings itself, not the folder around it.
    if folder == Path("/") or folder == Path.home() or folder == Path("/root") or folder.parent == Path("/home"):
        return [path]
    return [folder]


def _shebang(path: str) -> str | None:
    """The interpreter of a script's #! line (``/usr/bin/env node`` gives ``node``)."""
    try:
        with open(path, "rb") as handle:
            line = handle.readline(256)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    parts = line[2:].decode(errors="replace").split()
    if not parts:
        return None
    if os.path.basename(parts[0]) == "env":
        return next((part for part in parts[1:] if not part.startswith("-") and "=" not in part), None)
    return parts[0]


def sandbox_command(command: list[str], *, run_dir: Path, private: Private, needs: list[Path] = (),
                    expose: list[Exposed] = (), search_path: str | None = None,
                    door: list[str] | None = None, disk_mb: int = 0) -> list[str]:
    """bubblewrap around ``command``: the run sees what it needs and nothing of the runner's.
    Mounts apply in order: the system's trees and an empty /tmp (``_base_args``); what the run needs
    (stepmill's code and interpreter, the agent's install folders, a tokenizer, what the configuration
    exposes), read-only, parents first; /etc's secrets and the private folders and files hidden; last,
    its own folder, writable. ``door``: ``door_inside.py``'s arguments: the run gets a network of its
    own, whose only ways out they forward. ``disk_mb``: its folder is a tmpfs of that size instead
    (what the runner put there shown read-only, work and home empty and writable): what it writes
    fills that, never the disk, and is gone when it ends."""
    args = ["bwrap", *_base_args()]
    if door is not None:
        args.append("--unshare-net")
        command = [sys.executable, "-I", door_inside(), *door, "--", *command]
    wanted = {path.resolve(): False for path in [*code_paths(), *needs, *install_folders(command, search_path)]
              if path.exists()}
    for item in expose:
        wanted[item.path] = wanted.get(item.path, False) or item.writable
    shown = [Path(tree) for tree in SYSTEM_TREES if os.path.exists(tree)]
    for path in sorted(wanted, key=lambda p: len(p.parts)):
        if any(_within(path, tree) for tree in shown) and not wanted[path]:
            continue  # there already, read-only
        args += ["--bind" if wanted[path] else "--ro-bind", str(path), str(path)]
        shown.append(path)

    def visible(path: Path) -> bool:
        return any(_within(path, folder) for folder in shown)

    for secret in map(Path, ETC_SECRETS):
        if secret.is_dir():
            args += ["--tmpfs", str(secret)]
        elif secret.exists():
            args += ["--ro-bind", "/dev/null", str(secret)]
    for folder in private.folders:
        if folder.is_dir() and visible(folder):
            args += ["--tmpfs", str(folder)]
    for file in private.files:
        if file.exists() and visible(file):
            args += ["--ro-bind", "/dev/null", str(file)]
    if disk_mb:
        args += ["--size", str(disk_mb * 2**20), "--tmpfs", str(run_dir)]
        for path in sorted(run_dir.rglob("*")):
            args += ["--dir", str(path)] if path.is_dir() else ["--ro-bind", str(path), str(path)]
    else:
        args += ["--bind", str(run_dir), str(run_dir)]
    args += ["--chdir", str(run_dir / "work"), "--"]
    return args + command


def door_inside() -> str:
    from stepmill.runner.door import INSIDE

    return INSIDE


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
