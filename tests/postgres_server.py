"""A real PostgreSQL for tests: initdb in a temporary folder, started on a free port of 127.0.0.1, stopped at the end.

PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user (or ``nobody``)
in a folder that user owns. Authentication is ``trust`` for the superuser ``stepmill``, on
127.0.0.1 and on a unix socket in the folder only. ``fsync`` is off: the tests restart the server
(even with ``pg_ctl restart -m immediate``, which kills it) but never the machine, so committed
transactions survive as they would with it on.

Without PostgreSQL's binaries (Debian's ``postgresql``) the tests that need it skip and say so;
with ``STEPMILL_REQUIRE_ENGINES=1`` (CI) they fail instead.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from stepmill.children import free_port

REQUIRE = "STEPMILL_REQUIRE_ENGINES"
SUPERUSER = "stepmill"


def find_bindir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: $STEPMILL_PG_BIN, Debian's newest, or the PATH's."""
    candidates = [os.environ.get("STEPMILL_PG_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                         if Path(p).parent.name.isdigit() else 0, reverse=True)
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(str(Path(found).resolve().parent))
    for folder in candidates:
        if folder and all((Path(folder) / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return Path(folder)
    return None


def missing_reason() -> str | None:
    """Why PostgreSQL cannot be started here, or None when it can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    if find_bindir() is None:
        return "PostgreSQL's initdb/pg_ctl/postgres are not installed (apt-get install postgresql)"
    return None


def _server_user() -> tuple[int, int] | None:
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

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
                   " -c max_connections=60 -c shared_buffers=16MB")
        self._tool("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options)

    def restart(self, mode: str = "immediate") -> None:
        """``pg_ctl restart``: ``immediate`` kills the server (its clients' connections drop mid-transaction)
        and recovery replays the WAL; ``fast`` shuts it down cleanly first."""
        # -l again: pg_ctl remembers the server's options, not its log, and the server must not keep our pipe.
        self._tool("pg_ctl", "restart", "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w", "-t", "60")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._tool("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def new_database(self) -> str:
        """A fresh, empty database on the server: its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_postgres() -> PostgresServer:
    """initdb in a new temporary folder and start the server; the caller stops it (``stop()``)."""
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError(missing_reason() or "no PostgreSQL")
    owner = _server_user()
    # Not under pytest's tmp_path: its folders are root's alone, and the server's user must reach its own.
    root = Path(tempfile.mkdtemp(prefix="stepmill-pg-"))
    if owner:
        os.chown(root, *owner)
    server = PostgresServer(bindir, root, free_port(), owner)
    try:
        server._tool("initdb", "-D", str(server.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C",
                     "--no-sync", "--no-instructions", timeout=120)
        server.start()
    except BaseException:
        server.stop()
        raise
    return server
