"""``isolation = sandbox``: each run in bubblewrap, an unprivileged user of its own, alone.

- Files by allow-list (``files.py``): the system's read-only trees less /etc's secrets, the
  interpreter and stepmill's code, the agent's install folder, what ``[isolation] expose`` names, an
  empty ``/tmp`` but for its own run folder. The runner's files (proxy confdir, database, journals,
  dataset, configuration, other runs' folders) are not there.
- Its own PID, IPC, UTS (hostname ``stepmill-run``) and cgroup namespaces; with ``network = "own"``
  its own network, whose only way out is its door to the proxy (``door.py``).
- Never root on the host: started by a root runner, its first step (``sandbox_inside.py``) becomes
  the uid leased to the run (``uids.py``, from ``first_uid``); started by another user, it stays that user. Either way it
  then enters a user namespace of its own mapping only that uid, so its user keyring and its count
  of processes are its own; it joins a new session keyring; ``/proc/sys`` is read-only (by mount
  where the runner is root, by the files' modes everywhere: the run is not root); it runs with no
  capability and ``no_new_privs`` (bubblewrap's), so no setuid binary works.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from stepmill.children import die_with_parent
from stepmill.runner.isolation.files import (ETC_SECRETS, SYSTEM_TREES, Exposed, Private, code_paths,
                                             install_folders, within)
from stepmill.runner.isolation.policy import Policy, RunPlace, Start, give_to, own_home

INSIDE = str(Path(__file__).with_name("sandbox_inside.py"))
HOSTNAME = "stepmill-run"
# What the first step inside needs of root (to make /proc/sys read-only and become the run's uid), and
# never passes on: it drops them all before anything of the run starts.
ROOT_STEP_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN")
PROBE_UID = 65534  # nobody: the uid bwrap_problem's trial run becomes


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox a run here, or None when it can: tried once, for real, with the
    step that makes the run an unprivileged user of its own (user namespaces must be allowed) and
    stepmill's interpreter started as that user."""
    path = shutil.which("bwrap")
    if path is None:
        return "bubblewrap is not installed (Debian: apt-get install bubblewrap)"
    # What a run does first: the step inside, then stepmill's interpreter as the run's uid.
    command = [*first_step(PROBE_UID if os.geteuid() == 0 else None, 0), sys.executable, "-I", "-c", "pass"]
    trial = [path, *_base_args(), *_shown(command, [], [], None), *command]
    try:
        result = subprocess.run(trial, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run: {exc}"
    if result.returncode != 0:
        return f"bwrap fails here: {result.stderr.decode(errors='replace').strip()[:300]}"
    return None


def _base_args() -> list[str]:
    """A root of nothing (bwrap's empty tmpfs) with the system's trees in it, read-only."""
    args = ["--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", HOSTNAME,
            "--unshare-cgroup-try", "--new-session"]
    for tree in SYSTEM_TREES:
        if os.path.islink(tree):
            args += ["--symlink", os.readlink(tree), tree]
        elif os.path.isdir(tree):
            args += ["--ro-bind", tree, tree]
    # /tmp open to all, as on the host: the run is not root (bwrap makes a tmpfs 0755 otherwise)
    args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp", "--cap-drop", "ALL"]
    if os.geteuid() == 0:  # for the first step alone (sandbox_inside.py), which drops them
        for cap in ROOT_STEP_CAPS:
            args += ["--cap-add", cap]
    return args


def first_step(uid: int | None, nproc: int, own_network: bool = False, workdir: Path | None = None) -> list[str]:
    """``sandbox_inside.py``'s command line, up to the run's command: the uid to become (a root
    runner's runs), the processes it may have at once (0: the control group holds them), whether the
    network is the run's own (then its ports below 1024 are open to it; the host's are never changed),
    the folder it starts in."""
    become = ["--uid", str(uid), "--gid", str(uid)] if uid is not None else []
    return [sys.executable, "-I", "-S", INSIDE, *become, *(["--nproc", str(nproc)] if nproc else []),
            *(["--own-network"] if own_network else []), *(["--chdir", str(workdir)] if workdir else []), "--"]


def sandbox_command(command: list[str], *, run_dir: Path, private: Private, needs: list[Path] = (),
                    expose: list[Exposed] = (), search_path: str | None = None,
                    door: list[str] | None = None, disk_mb: int = 0, uid: int | None = None,
                    nproc: int = 0, etc: dict[str, Path] | None = None) -> list[str]:
    """bubblewrap around ``command``: the run sees what it needs and nothing of the runner's.
    Mounts apply in order: the system's trees and an empty /tmp (``_base_args``); what the run needs
    (stepmill's code and interpreter, the agent's install folders, a tokenizer, what the configuration
    exposes), read-only, parents first; /etc's secrets and the private folders and files hidden; last,
    its own folder, writable. ``door``: ``door_inside.py``'s arguments: the run gets a network of its
    own, whose only ways out they forward. ``disk_mb``: its folder is a tmpfs of that size instead
    (what the runner put there shown read-only, work and home empty and writable): what it writes
    fills that, never the disk, and is gone when it ends. ``uid``: the uid a root runner's run
    becomes; ``nproc``: its processes at once, counted in its own user namespace; ``etc``: files shown
    over /etc's (``/etc/passwd`` naming the run's uid), read-only."""
    args = ["bwrap", *_base_args()]
    if door is not None:
        from stepmill.runner.door import INSIDE as DOOR_INSIDE

        args.append("--unshare-net")
        command = [sys.executable, "-I", DOOR_INSIDE, *door, "--", *command]
    command = first_step(uid, nproc, own_network=door is not None, workdir=run_dir / "work") + command
    args += _shown(command, needs, expose, search_path)
    args += _hidden(args, private)
    for name, source in (etc or {}).items():
        args += ["--ro-bind", str(source), f"/etc/{name}"]
    args += _parents(run_dir, [Path(tree) for tree in SYSTEM_TREES], set())
    if disk_mb:
        args += ["--size", str(disk_mb * 2**20), "--perms", "0755", "--tmpfs", str(run_dir)]
        for path in sorted(run_dir.rglob("*")):
            args += ["--perms", "0777", "--dir", str(path)] if path.is_dir() else ["--ro-bind", str(path), str(path)]
    else:
        args += ["--bind", str(run_dir), str(run_dir)]
    args += ["--chdir", "/", "--"]  # its work folder is entered as the run (sandbox_inside.py)
    return args + command


def _shown(command: list[str], needs: list[Path], expose: list[Exposed], search_path: str | None) -> list[str]:
    """Read-only binds of what the run needs, parents first (one within a shown tree is there already)."""
    installs = install_folders(command, search_path)
    wanted = {path.resolve(): False for path in [*code_paths(), *needs, *installs] if path.exists()}
    for item in expose:
        wanted[item.path] = wanted.get(item.path, False) or item.writable
    shown = [Path(tree) for tree in SYSTEM_TREES if os.path.exists(tree)]
    args, made = [], set()
    for path in sorted(wanted, key=lambda p: len(p.parts)):
        if any(within(path, tree) for tree in shown) and not wanted[path]:
            continue  # there already, read-only
        args += _parents(path, shown, made) + ["--bind" if wanted[path] else "--ro-bind", str(path), str(path)]
        shown.append(path)
    for path in [*(Path(part) for part in command if part.startswith("/")), *needs, *installs]:
        args += _links(path, shown, made)
    return args


def _links(path: Path, shown: list[Path], made: set) -> list[str]:
    """The symlinks on the way to a path the run names (a checkout's ``.venv`` linked into a cache):
    made as on the host, since the binds are at their targets (resolved)."""
    args, current = [], Path("/")
    for part in path.parts[1:]:
        current = current / part
        if not current.is_symlink():
            continue
        if current not in made and not any(within(current, tree) for tree in shown):
            target = os.readlink(current)
            args += _parents(current, shown, made) + ["--symlink", target, str(current)]
            made.add(current)
            args += _links(current.parent / target, shown, made)  # a link to a link: each made in turn
        current = current.resolve()  # the rest of the way from its target
    return args


def _parents(path: Path, shown: list[Path], made: set) -> list[str]:
    """The folders above ``path``, made first and open to all: bwrap would copy the host's modes (/root's
    0700, a private temporary folder's), which shut out a run that is not root. (``--dir`` leaves one
    that is there already as it is: /tmp stays 1777.)"""
    args = []
    for parent in reversed(path.parents):
        if parent != Path("/") and parent not in made and not any(within(parent, tree) for tree in shown):
            args += ["--perms", "0755", "--dir", str(parent)]
            made.add(parent)
    return args


def _hidden(args: list[str], private: Private) -> list[str]:
    """/etc's secrets and the runner's private folders and files, wherever the binds so far show them."""
    shown = [Path(tree) for tree in SYSTEM_TREES if os.path.exists(tree)]
    shown += [Path(args[i + 2]) for i, part in enumerate(args[:-2]) if part in ("--bind", "--ro-bind")]

    def visible(path: Path) -> bool:
        return any(within(path, folder) for folder in shown)

    hidden = []
    for secret in map(Path, ETC_SECRETS):
        if secret.is_dir():
            hidden += ["--tmpfs", str(secret)]
        elif secret.exists():
            hidden += ["--ro-bind", "/dev/null", str(secret)]
    for folder in private.folders:
        if folder.is_dir() and visible(folder):
            hidden += ["--tmpfs", str(folder)]
    for file in private.files:
        if file.exists() and visible(file):
            hidden += ["--ro-bind", "/dev/null", str(file)]
    return hidden


def named_user(place: RunPlace) -> dict[str, Path]:
    """/etc/passwd and /etc/group as the run sees them: the host's, and its uid named (``stepmill-run``,
    its home) where the host names it not — programs ask who they are (Node's ``os.userInfo``)."""
    import grp
    import pwd

    files = {}
    for name, known, line in (
            ("passwd", _known(pwd.getpwuid, place.uid), f"stepmill-run:x:{place.uid}:{place.uid}:stepmill run:"
                                                        f"{place.home}:/bin/sh"),
            ("group", _known(grp.getgrgid, place.uid), f"stepmill-run:x:{place.uid}:")):
        if known:
            continue
        files[name] = place.run_dir / f"etc-{name}"
        host = Path(f"/etc/{name}").read_text() if Path(f"/etc/{name}").exists() else ""
        files[name].write_text(host.rstrip("\n") + "\n" + line + "\n")
        files[name].chmod(0o644)
    return files


def _known(lookup, number: int) -> bool:
    try:
        lookup(number)
        return True
    except KeyError:
        return False


class Sandbox(Policy):
    name = "sandbox"
    counts_own_processes = True

    def __init__(self, isolation, private: Private):
        super().__init__(isolation, private)
        self.as_root = os.geteuid() == 0  # then each run becomes its leased uid

    def sees(self, place: RunPlace) -> dict[str, str]:
        home = own_home(place)
        os.chmod(place.run_dir, 0o755)  # the runner's, open to the run (its CA bundle); nothing private in it
        for folder in (place.workdir, place.home):
            os.chmod(folder, 0o700)  # the run's alone
        if self.as_root:  # its work and home are its own uid's; the folder around them stays the runner's
            for folder in (place.workdir, place.home):
                give_to(folder, place.uid)
            if place.door_folder is not None:  # its door's inside half runs as the run's uid too
                os.chown(place.door_folder, place.uid, place.uid)
        return home

    def start(self, place: RunPlace, command: list[str], env: dict, nproc: int) -> Start:
        command = sandbox_command(command, run_dir=place.run_dir, private=self.private, needs=place.needs,
                                  expose=self.isolation.expose, search_path=env.get("PATH"), door=place.door,
                                  disk_mb=self.isolation.limits.disk_mb, nproc=nproc,
                                  uid=place.uid if self.as_root else None,
                                  etc=named_user(place) if self.as_root else None)
        return Start(command, die_with_parent)


POLICY = Sandbox
