"""A sandboxed run's only way out: its door.

Each sandboxed run has a network namespace of its own (``bwrap --unshare-net``) holding nothing but
loopback. What it may reach is forwarded in: inside, ``door_inside.py`` listens on the loopback
ports the run was told and carries each connection to a unix socket in the run's folder; outside,
``Doors`` (one event loop thread of the runner) carries it on to the proxy — from the run's own
loopback address (127.a.b.c, registered with the run), so the proxy knows from the connection
alone which run sent a call. A white-box run's door to its engine reads each request's head first:
one request per connection, and no admin route (``stepmill.auth.admin_routes``).

Nothing else is reachable from a run: not another run, not a service on the host's loopback, not
the internet but through the proxy, which decides what of it a run may reach.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from stepmill.auth.admin_routes import is_admin_route

INSIDE = str(Path(__file__).with_name("door_inside.py"))
HEAD_LIMIT = 64 * 1024  # bytes of a request head the engine door reads at most


def new_address() -> str:
    """A loopback address of the run's own, never 127.0.0.x (where every local client is)."""
    return f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"


@dataclass(frozen=True)
class Way:
    """One thing a run reaches: ``port`` on its loopback, carried to ``host:port`` outside."""

    port: int  # inside the run, on 127.0.0.1
    host: str
    target_port: int
    http_gate: bool = False  # an engine: one request per connection, admin routes refused


def way_to(url: str, *, http_gate: bool = False) -> Way:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Way(port, parts.hostname or "127.0.0.1", port, http_gate)


class Doors:
    """The runner's side of every door: unix sockets served on one event loop thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.servers: dict[str, list] = {}
        self.folders: dict[str, Path] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, name="stepmill-doors", daemon=True)
        self.thread.start()

    def open(self, key: str, address: str, ways: list[Way]) -> tuple[list[str], Path]:
        """The run's door: a socket per way in a folder of its own (a short path: a unix socket's is at
        most 107 bytes), which the run's sandbox shows it; answers ``door_inside.py``'s arguments and
        the folder."""
        folder = Path(tempfile.mkdtemp(prefix="stepmill-door-", dir="/tmp" if os.access("/tmp", os.W_OK) else None))
        args = []
        servers = []
        for index, way in enumerate(ways):
            path = str(folder / f"{index}.sock")
            handler = self._gate if way.http_gate else self._carry
            server = asyncio.run_coroutine_threadsafe(asyncio.start_unix_server(
                lambda r, w, way=way: handler(r, w, way, address), path), self.loop).result(30)
            os.chmod(path, 0o666)  # the run may be another uid (root in the sandbox needs no mode)
            servers.append(server)
            args += ["--listen", f"{way.port}={path}"]
        self.servers[key] = servers
        self.folders[key] = folder
        return args, folder

    def close(self, key: str) -> None:
        for server in self.servers.pop(key, []):
            self.loop.call_soon_threadsafe(server.close)
        folder = self.folders.pop(key, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def stop(self) -> None:
        for key in list(self.servers):
            self.close(key)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _connect(self, way: Way, address: str):
        return await asyncio.open_connection(way.host, way.target_port, local_addr=(address, 0))

    async def _carry(self, reader, writer, way: Way, address: str) -> None:
        try:
            up_reader, up_writer = await self._connect(way, address)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        writer.close()
        up_writer.close()

    async def _gate(self, reader, writer, way: Way, address: str) -> None:
        """One request: its head read whole and checked, its body (Content-Length) carried, then the
        answer until the engine closes. What follows the body is never sent on."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.rpartition(" ")[0] or rest
        path = urllib.parse.urlsplit(target).path if "://" in target else target
        headers = [line for line in lines[1:] if line]
        names = {line.partition(":")[0].strip().lower() for line in headers}
        length = next((line.partition(":")[2].strip() for line in headers
                       if line.partition(":")[0].strip().lower() == "content-length"), "0")
        refusal = None
        if is_admin_route(path):
            refusal = b"403 Forbidden", b"an engine's admin routes are not for runs"
        elif "transfer-encoding" in names or not length.isdigit():
            refusal = b"411 Length Required", b"a run's request to its engine needs a Content-Length"
        if refusal is not None:
            body = b'{"error": "stepmill: ' + refusal[1] + b'"}'
            writer.write(b"HTTP/1.1 " + refusal[0] + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await _close(writer)
            return
        try:
            up_reader, up_writer = await self._connect(way, address)
        except OSError:
            writer.close()
            return
        kept = [line for line in headers if line.partition(":")[0].strip().lower() not in ("connection", "keep-alive")]
        up_writer.write(("\r\n".join([lines[0], *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1"))
        try:
            up_writer.write(await reader.readexactly(int(length)))
        except (asyncio.IncompleteReadError, OSError):
            await _close(up_writer)
            writer.close()
            return
        await _pump(up_reader, writer)
        await _close(up_writer)


async def _pump(reader, writer) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
        except OSError:
            writer.close()


async def _close(writer) -> None:
    try:
        await writer.drain()
    except OSError:
        pass
    writer.close()
