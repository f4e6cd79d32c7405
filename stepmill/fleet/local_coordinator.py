"""A local PostgreSQL coordinator: initdb in a folder, started on a port of 127.0.0.1, stopped on demand.

`stepmill fleet up` keeps one in its folder (started again, or reused, by the next `up`); the tests start a
throwaway one per session (``start_postgres()``). PostgreSQL refuses to run as root, so as root the server
runs as the ``postgres`` user (or ``nobody``) in a folder that user owns. Authentication is ``trust`` for
the superuser ``stepmill``, on 127.0.0.1 and on a unix socket in the folder only: any process on this
machine can connect, which is what a fleet tried on one machine needs and no more. ``fsync`` is off: the
server is restarted (even killed) but the machine is not, so committed transactions survive as they would
with it on.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from stepmill.children import free_port

SUPERUSER = "stepmill"
DATABASE = "stepmill"  # the database `stepmill fleet up` makes for the coordinator
SOCKET_PATH_MAX = 90  # a unix socket's path is at most 107 bytes: longer folders get none (TCP only)


def find_bindir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: $STEPMILL_PG_BIN, Debian's newest, or the PATH's."""
    candidates = [os.environ.get("STEPMILL_PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                         if Path(p).parent.name.isdigit() else 0, reverse=True)
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(str(Path(found).resolve().parent))
    for folder in candidates:
        if folder and all((Path(folder) / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "createdb")):
            return Path(folder)
    return None


def missing_reason() -> str | None:
    """Why PostgreSQL cannot be started here, or None when it can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'stepmill[fleet]')"
    if find_bindir() is None:
        return "PostgreSQL's initdb/pg_ctl/postgres are not installed (apt-get install postgresql)"
    return None


def server_user() -> tuple[int, int] | None:
    """(uid, gid) to run the server as when we are root; None when we are not."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    raise RuntimeError("running as root and neither a postgres nor a nobody user exists to run PostgreSQL as")


@dataclass
class PostgresServer:
    bindir: Path
    root: Path  # owned by the server's user: data/, the socket, the log
    port: int
    owner: tuple[int, int] | None
    temporary: bool = False  # stop() deletes the folder too

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _tool(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        kwargs = {}
        if self.owner:
            kwargs = {"user": self.owner[0], "group": self.owner[1], "extra_groups": []}
        result = subprocess.run([str(self.bindir / args[0]), *args[1:]], cwd=self.root, capture_output=True, text=True,
                                timeout=timeout, env={**os.environ, "LC_ALL": "C", "PGTZ": "UTC"}, **kwargs)
        if result.returncode:
            raise RuntimeError(f"{args[0]} failed ({result.returncode}): {result.stderr.strip()}\n{self.log_tail()}")
        return result

    def initdb(self) -> None:
        self._tool("initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C",
                   "--no-sync", "--no-instructions", timeout=120)

    def start(self) -> None:
        sockets = str(self.root) if len(str(self.root)) <= SOCKET_PATH_MAX else "''"
        options = (f"-p {self.port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
                   " -c max_connections=60 -c shared_buffers=16MB")
        self._tool("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options)

    def running(self) -> bool:
        """``pg_ctl status``: a server runs on this folder's data."""
        if not (self.data / "postmaster.pid").exists():
            return False
        try:
            self._tool("pg_ctl", "status", "-D", str(self.data))
            return True
        except RuntimeError:
            return False

    def restart(self, mode: str = "immediate") -> None:
        """``pg_ctl restart``: ``immediate`` kills the server (its clients' connections drop mid-transaction)
        and recovery replays the WAL; ``fast`` shuts it down cleanly first."""
        # -l again: pg_ctl remembers the server's options, not its log, and the server must not keep our pipe.
        self._tool("pg_ctl", "restart", "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w", "-t", "60")

    def stop(self, mode: str = "immediate") -> None:
        """The server stopped (``fast``: cleanly; ``immediate``: killed), and a temporary folder deleted."""
        if (self.data / "postmaster.pid").exists():
            try:
                self._tool("pg_ctl", "stop", "-D", str(self.data), "-m", mode, "-w", "-t", "30")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """The database made (``createdb``) unless it exists: its URL."""
        try:
            self._tool("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, name)
        except RuntimeError as exc:
            if "already exists" not in str(exc):
                raise
        return self.url(name)

    def new_database(self) -> str:
        """A fresh, empty database on the server: its URL."""
        return self.create_database(f"t_{uuid.uuid4().hex[:12]}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _initialised(server: PostgresServer) -> PostgresServer:
    """The server's folder made its user's, initdb run there, the server started; stopped again on failure."""
    if server.owner:
        os.chown(server.root, *server.owner)
    try:
        if not (server.data / "PG_VERSION").exists():
            server.initdb()
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


def _bindir() -> Path:
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError(missing_reason() or "no PostgreSQL")
    return bindir


def start_postgres() -> PostgresServer:
    """initdb in a new temporary folder and start the server; the caller stops it (``stop()`` deletes it)."""
    # Not under pytest's tmp_path: its folders are root's alone, and the server's user must reach its own.
    root = Path(tempfile.mkdtemp(prefix="stepmill-pg-"))
    return _initialised(PostgresServer(_bindir(), root, free_port(), server_user(), temporary=True))


def _reachable(folder: Path, owner: tuple[int, int]) -> bool:
    """Whether the user ``owner`` may pass through every folder above ``folder`` (search permission)."""
    groups = set(os.getgrouplist(pwd.getpwuid(owner[0]).pw_name, owner[1]))
    for above in folder.resolve().parents:
        mode = above.stat()
        if mode.st_uid == owner[0]:
            bit = stat.S_IXUSR
        elif mode.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not mode.st_mode & bit:
            return False
    return True


def server_folder(fleet_dir: Path) -> Path:
    """Where `fleet up` keeps its PostgreSQL: ``DIR/postgres``, or, as root where the server's user cannot
    reach DIR (under /root, say), a folder in /var/tmp named after DIR that ``DIR/postgres`` links to."""
    link = fleet_dir / "postgres"
    owner = server_user()
    if link.is_symlink() or owner is None or _reachable(link, owner):
        return link.resolve() if link.is_symlink() else link
    digest = hashlib.sha256(str(fleet_dir.resolve()).encode()).hexdigest()[:12]
    elsewhere = Path("/var/tmp") / f"stepmill-fleet-pg-{digest}"
    elsewhere.mkdir(mode=0o700, exist_ok=True)
    link.symlink_to(elsewhere)
    return elsewhere


def coordinator_up(fleet_dir: Path, port: int | None) -> tuple[PostgresServer, bool]:
    """The folder's PostgreSQL, initialised the first time and started unless it runs, with the database
    ``stepmill``: (the server, whether it was running already). ``port``: where a stopped server starts
    (default: the one it had, if free, else a free one)."""
    root = server_folder(fleet_dir)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = PostgresServer(_bindir(), root, port or 0, server_user())
    was_running = server.running()
    if was_running:
        server.port = int((server.data / "postmaster.pid").read_text().splitlines()[3])
    else:
        server.port = port or _earlier_port(server) or free_port()
        _initialised(server)
    server.create_database(DATABASE)
    return server, was_running


def _earlier_port(server: PostgresServer) -> int | None:
    """The port the folder's server had last (``postmaster.opts``), if nothing listens there now."""
    try:
        words = [word.strip('"') for word in (server.data / "postmaster.opts").read_text().split()]
        port = int(words[words.index("-p") + 1])
    except (OSError, ValueError, IndexError):
        return None
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port


def coordinator_down(fleet_dir: Path) -> bool:
    """The folder's PostgreSQL stopped cleanly (its data kept); whether one was running."""
    link = fleet_dir / "postgres"
    if not link.exists():
        return False
    server = PostgresServer(_bindir(), link.resolve(), 0, server_user())
    was_running = server.running()
    server.stop(mode="fast")
    return was_running
