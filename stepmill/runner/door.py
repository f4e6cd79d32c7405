"""A sandboxed run's only way out: its door.

Each sandboxed run has a network namespace of its own (``bwrap --unshare-net``) holding nothing but
loopback. What it may reach is forwarded in: inside, ``door_inside.py`` listens on the loopback
ports the run was told and carries each connection to a unix socket in the run's folder; outside,
``Doors`` (one event loop thread of the runner) carries it on. To the proxy, the first request head
of each connection gets the run's door key (``DOOR_HEADER``; any the run wrote is dropped): the
proxy binds the connection to the run by it, and the run never sees the key, so no other process
of the host can be the run. A white-box run's door to its engine reads each request's head first
(one request per connection, on inference routes alone: ``stepmill.auth.admin_routes``) and each answer's
token ids and weight versions (``door_answers``): a step's policy version is what the runner saw
the engine say, never what the run reports.

Nothing else is reachable from a run: not another run, not a service on the host's loopback, not
the internet but through the proxy, which decides what of it a run may reach.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from stepmill.auth.admin_routes import INFERENCE_ROUTES, is_inference_route
from stepmill.auth.runs import DOOR_HEADER
from stepmill.auth.secret_hashes import new_secret
from stepmill.runner.door_answers import EngineAnswers

INSIDE = str(Path(__file__).with_name("door_inside.py"))
HEAD_LIMIT = 64 * 1024  # bytes of a request head a door reads at most (longer: the connection is closed)
MAX_BODY = 64 * 1024 * 1024  # bytes of a request body the engine door carries (the proxy's stepmill_max_body)
NAMED_ROUTES = ", ".join(sorted(INFERENCE_ROUTES)).encode()
CHUNK = 65536  # bytes carried at a time: what a run sends never piles up in the runner


def new_key() -> str:
    """A run's door key: the runner registers its hash with the proxy and adds it to what the door
    carries; the run never holds it."""
    return new_secret()


@dataclass(frozen=True)
class Way:
    """One thing a run reaches: ``port`` on its loopback, carried to ``host:port`` outside."""

    port: int  # inside the run, on 127.0.0.1
    host: str
    target_port: int
    http_gate: bool = False  # an engine: one request per connection, inference routes alone


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
        self.answers: dict[str, EngineAnswers] = {}  # per run: what its engine door saw the engine answer
        self.thread = threading.Thread(target=self.loop.run_forever, name="stepmill-doors", daemon=True)
        self.thread.start()

    def open(self, key: str, door_key: str, ways: list[Way]) -> tuple[list[str], Path]:
        """The run's door: a socket per way in a folder of its own (a short path: a unix socket's is at
        most 107 bytes), which the run's sandbox shows it; answers ``door_inside.py``'s arguments and
        the folder. ``door_key`` goes to the proxy with each connection, never to an engine."""
        folder = Path(tempfile.mkdtemp(prefix="stepmill-door-", dir="/tmp" if os.access("/tmp", os.W_OK) else None))
        args = []
        servers = []
        answers = self.answers[key] = EngineAnswers()
        for index, way in enumerate(ways):
            path = str(folder / f"{index}.sock")
            if way.http_gate:
                handler = lambda r, w, way=way: self._gate(r, w, way, answers)  # noqa: E731
            else:
                handler = lambda r, w, way=way: self._carry(r, w, way, door_key)  # noqa: E731
            serving = asyncio.start_unix_server(handler, path, limit=HEAD_LIMIT)  # a longer head: closed
            server = asyncio.run_coroutine_threadsafe(serving, self.loop).result(30)
            os.chmod(path, 0o666)  # the run may be another uid (root in the sandbox needs no mode)
            servers.append(server)
            args += ["--listen", f"{way.port}={path}"]
        self.servers[key] = servers
        self.folders[key] = folder
        return args, folder

    def engine_answers(self, key: str) -> EngineAnswers | None:
        """What the run's engine door saw the engine answer (None: the run has no door)."""
        return self.answers.get(key)

    def close(self, key: str) -> None:
        """The run's door shut; what its engine answered stays readable until ``forget``."""
        for server in self.servers.pop(key, []):
            self.loop.call_soon_threadsafe(server.close)
        folder = self.folders.pop(key, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def forget(self, key: str) -> None:
        self.answers.pop(key, None)

    def stop(self) -> None:
        for key in list(self.servers):
            self.close(key)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _carry(self, reader, writer, way: Way, door_key: str) -> None:
        """To the proxy: the first request head with the run's door key instead of any the run wrote,
        then both ways as they come. What is no HTTP/1 request is not carried."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.close()
            return
        keyed = with_door_key(head, door_key)
        if keyed is None:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(way.host, way.target_port)
        except OSError:
            writer.close()
            return
        up_writer.write(keyed)
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        writer.close()
        up_writer.close()

    async def _gate(self, reader, writer, way: Way, answers: EngineAnswers) -> None:
        """One request: its head read whole and checked, its body (Content-Length, at most
        ``MAX_BODY``) carried as it comes, then the answer until the engine closes, read as it passes
        (``answers``). What follows the body is never sent on."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.close()
            return
        seen = answers.reading()  # the answer's time is when the door saw the request
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.rpartition(" ")[0] or rest
        path = urllib.parse.urlsplit(target).path if "://" in target else target
        headers = [line for line in lines[1:] if line]
        names = {line.partition(":")[0].strip().lower() for line in headers}
        length = next((line.partition(":")[2].strip() for line in headers
                       if line.partition(":")[0].strip().lower() == "content-length"), "0")
        refusal = None
        if not is_inference_route(path):
            refusal = b"403 Forbidden", b"a run's engine door opens onto inference routes alone: " + NAMED_ROUTES
        elif "transfer-encoding" in names or not length.isdigit():
            refusal = b"411 Length Required", b"a run's request to its engine needs a Content-Length"
        elif int(length) > MAX_BODY:
            refusal = (b"413 Content Too Large",
                       b"a run's request to its engine is at most %d bytes" % MAX_BODY)
        if refusal is not None:
            body = b'{"error": "stepmill: ' + refusal[1] + b'"}'
            writer.write(b"HTTP/1.1 " + refusal[0] + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await _close(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(way.host, way.target_port)
        except OSError:
            writer.close()
            return
        kept = [line for line in headers if line.partition(":")[0].strip().lower() not in ("connection", "keep-alive")]
        head = ("\r\n".join([lines[0], *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")
        try:
            # A body of one chunk goes with its head in one write: an engine that answers before reading the
            # body (vLLM's 403 for a route it has not enabled) and closes would otherwise reset the
            # connection under the body's later bytes, and its answer would be lost to the run.
            first = await reader.readexactly(min(int(length), CHUNK))
            up_writer.write(head + first)
            await _carry_body(reader, up_writer, int(length) - len(first))
        except (asyncio.IncompleteReadError, OSError):
            await _close(up_writer)
            writer.close()
            return
        await _pump_answer(up_reader, writer, answers, seen)
        await _close(up_writer)


def with_door_key(head: bytes, door_key: str) -> bytes | None:
    """An HTTP/1 request head (CONNECT, a plain request, a WebSocket upgrade) with the door key as its
    only ``DOOR_HEADER``; None for anything else."""
    lines = head[:-4].split(b"\r\n")
    words = lines[0].split(b" ")
    if len(words) != 3 or not words[2].startswith(b"HTTP/1.") or not words[0].isalpha():
        return None
    name = DOOR_HEADER.lower().encode()
    kept = [line for line in lines[1:] if line.partition(b":")[0].strip().lower() != name]
    return b"\r\n".join([lines[0], DOOR_HEADER.encode() + b": " + door_key.encode(), *kept]) + b"\r\n\r\n"


async def _carry_body(reader, writer, length: int) -> None:
    """``length`` bytes of a run's request body to the engine, a chunk at a time."""
    while length:
        data = await reader.readexactly(min(length, CHUNK))
        writer.write(data)
        await writer.drain()
        length -= len(data)


async def _pump_answer(reader, writer, answers: EngineAnswers, seen) -> None:
    """The engine's answer to the run, read as it passes (``seen``). The last piece is held until the
    engine closed and the answer was read: the run never has a whole answer the runner has not seen."""
    held = b""
    try:
        while data := await reader.read(65536):
            if held:
                writer.write(held)
                await writer.drain()
            seen.add(data)
            held = data
        await asyncio.get_running_loop().run_in_executor(None, answers.keep, seen)  # other doors go on meanwhile
        writer.write(held)
        await writer.drain()
    except OSError:
        pass
    finally:
        _end(writer)


async def _pump(reader, writer) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        _end(writer)


def _end(writer) -> None:
    """No more to send: half-closed where the socket allows (the answer may still come), else closed."""
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
