"""The private channel between the worker processes of one `stepmill proxy --workers N`.

Each worker listens on a Unix socket ``worker-<id>.sock`` in a folder the supervisor made 0700 for
this proxy alone (``STEPMILL_WORKERS_DIR``), and every message carries the write token: nothing an
agent reaches (the proxy's ports, the control host) leads here, and a process that can open the folder
still needs the token. A message is one JSON line, its answer one JSON line.

The server runs on the worker's event loop; ``ask`` is called on the loop (a barrier waits on its
siblings without blocking it), ``tell`` from a thread off the loop (the control thread).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger("stepmill")

ENV_DIR = "STEPMILL_WORKERS_DIR"  # set by the supervisor (stepmill.proxy_master) for its workers
ENV_ID = "STEPMILL_WORKER"
ENV_COUNT = "STEPMILL_WORKERS"
LINE_LIMIT = 1024 * 1024  # bytes of one message at most
RETRY = 0.1  # seconds between tries at a sibling that died, until its restart listens

Handler = Callable[[dict], Awaitable[dict]]


def socket_path(folder: str | os.PathLike, worker_id: int) -> Path:
    return Path(folder) / f"worker-{worker_id}.sock"


class Siblings:
    def __init__(self, folder: str, worker_id: int, count: int, token: str):
        self.folder = Path(folder)
        self.id = worker_id
        self.count = count
        self.token = token
        self.server: asyncio.AbstractServer | None = None

    @classmethod
    def from_env(cls, token: str) -> "Siblings | None":
        """This process's channel when it is one of several workers; None when it is the only one."""
        folder = os.environ.get(ENV_DIR)
        if not folder or os.environ.get(ENV_ID) is None:
            return None
        return cls(folder, int(os.environ[ENV_ID]), int(os.environ.get(ENV_COUNT) or 0), token)

    def others(self) -> list[Path]:
        return [socket_path(self.folder, i) for i in range(self.count) if i != self.id]

    # -- the server, on the event loop ------------------------------------------------------
    async def serve(self, handlers: dict[str, Handler]) -> None:
        path = socket_path(self.folder, self.id)
        fresh = path.with_suffix(".new")
        fresh.unlink(missing_ok=True)
        old = os.umask(0o177)  # the socket is 0600 from its creation, inside a 0700 folder
        try:
            self.server = await asyncio.start_unix_server(lambda r, w: self._answer(r, w, handlers), path=str(fresh),
                                                          limit=LINE_LIMIT)
        finally:
            os.umask(old)
        # Over the dead socket of this worker's previous life in one step: siblings never find it missing.
        os.replace(fresh, path)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      handlers: dict[str, Handler]) -> None:
        try:
            message = json.loads(await reader.readline())
            if not isinstance(message, dict) or not hmac.compare_digest(
                    str(message.get("token", "")).encode(), self.token.encode()):
                answer = {"error": "refused"}
            elif message.get("op") not in handlers:
                answer = {"error": f"no operation {message.get('op')!r}"}
            else:
                answer = await handlers[message["op"]](message)
        except Exception as exc:
            log.exception("stepmill: a message from a sibling worker failed")
            answer = {"error": str(exc)}
        try:
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
            writer.close()
        except OSError:
            pass  # the sibling gave up waiting

    # -- asking the others ------------------------------------------------------------------
    def _message(self, op: str, fields: dict) -> bytes:
        return json.dumps({"op": op, "token": self.token, "from": self.id, **fields}).encode() + b"\n"

    async def ask(self, op: str, timeout: float, **fields) -> list[dict]:
        """On the loop: every other worker's answer, asked at once. A worker that has not started yet
        (no socket) answers ``{"absent": True}``; one that died (its socket refuses) is asked again until
        its restart answers or ``timeout`` passes, then ``{"error": ...}``."""
        return list(await asyncio.gather(*(self._ask_one(path, op, fields, timeout) for path in self.others())))

    async def _ask_one(self, path: Path, op: str, fields: dict, timeout: float) -> dict:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        reader, writer = await asyncio.open_unix_connection(str(path), limit=LINE_LIMIT)
                        break
                    except FileNotFoundError:
                        return {"absent": True, "worker": path.stem}
                    except ConnectionRefusedError:
                        await asyncio.sleep(RETRY)  # dead: the supervisor starts it again
                try:
                    writer.write(self._message(op, fields))
                    await writer.drain()
                    return json.loads(await reader.readline())
                finally:
                    writer.close()
        except (OSError, TimeoutError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "worker": path.stem}

    def tell(self, op: str, timeout: float = 5.0, **fields) -> list[dict]:
        """Off the loop (it blocks): every other worker's answer, one after the other."""
        answers = []
        for path in self.others():
            deadline = time.monotonic() + timeout
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(timeout)
                    conn.connect(str(path))
                    conn.sendall(self._message(op, fields))
                    data = b""
                    while not data.endswith(b"\n") and time.monotonic() < deadline:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                answers.append(json.loads(data))
            except (OSError, ValueError) as exc:
                answers.append({"error": f"{type(exc).__name__}: {exc}", "worker": path.stem})
        return answers
