"""What of the host a sandboxed run sees: the system's read-only trees less /etc's secrets, the
interpreter and stepmill's code, the agent's own install folder, what ``[isolation] expose`` names;
and what it never sees: the runner's files (``Private``). ``sandbox.py`` turns this into mounts."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from stepmill.errors import ConfigError

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
        keeps = [*code_paths(), Path(sys.executable).resolve()]
        # Whole folders where they hold nothing a run needs: other copies and later files go with them
        # (the runs' root beside the database too: a run's own folder is mounted after, over them).
        for folder in (db_path.parent, Path(dataset).resolve().parent):
            if not any(within(keep, folder) for keep in keeps):
                folders.append(folder)
        # A checkout's history holds every version of its files (a bundled dataset's answers too).
        folders += sorted({folder / ".git" for path in code_paths() for folder in (path, *path.parents)
                           if (folder / ".git").is_dir()})
        return cls(folders, files)


def within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


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
    symlink on the way followed. Its programs are the command's absolute parts and its bare words that
    name a program on the run's PATH (command[0], or the one a shell line starts: ``sh -c '… exec "$0"'
    gemini``). A word that only happens to name one shows that program's folder: what is on the run's PATH
    (the runner's own) is the run's to start anyway, and ``Private`` stays hidden over whatever is shown."""
    found: list[Path] = []
    on_path = [shutil.which(part, path=search_path) if _bare_word(part) else None for part in command]
    todo = [part for part in [*command, *on_path] if part and part.startswith("/") and os.path.exists(part)]
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


def _bare_word(part: str) -> bool:
    """A program's name as a command gives it: one word, no path (a task's text is never looked up)."""
    return 0 < len(part) <= 255 and "/" not in part and not any(c.isspace() for c in part)


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


