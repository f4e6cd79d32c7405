"""A lean OpenAI-style upstream for proxy benchmarks: an asyncio Protocol, HTTP/1.1 keep-alive.

It costs far less CPU per request than any proxy in front of it, so the benchmark measures the
proxy. POST with ``"stream": true`` in the body answers N chat.completion.chunk events (the
first at once, then one every ``delay`` seconds) and ``[DONE]``; anything else a small
chat.completion.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from pathlib import Path

CHUNK = ('data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"bench",'
         '"choices":[{"index":0,"delta":{"content":"token %d "},"finish_reason":null}]}\n\n')
PLAIN = json.dumps({"id": "chatcmpl-b", "object": "chat.completion", "created": 1, "model": "bench",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from bench."},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}).encode()


class Handler(asyncio.Protocol):
    def __init__(self, events: int, delay: float):
        self.events, self.delay = events, delay
        self.buffer = b""
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1")
            length, events, delay = 0, self.events, self.delay
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "x-bench-events":  # per-request shape: slow streams
                    events = int(value)
                elif name == "x-bench-delay":
                    delay = float(value)
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4: head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length:]
            if b'"stream": true' in body[:200] or b'"stream":true' in body[:200]:
                asyncio.ensure_future(self.stream(events, delay))
            else:
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                     + str(len(PLAIN)).encode() + b"\r\n\r\n" + PLAIN)

    async def stream(self, events: int, delay: float):
        write = self.transport.write
        write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(events):
            if i:
                await asyncio.sleep(delay)
            if self.transport.is_closing():
                return
            data = (CHUNK % i).encode()
            write(b"%x\r\n%s\r\n" % (len(data), data))
        done = b'data: {"id":"chatcmpl-b","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


async def serve(host: str, port: int, *, events: int, delay: float, tls: ssl.SSLContext | None = None):
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Handler(events, delay), host, port, ssl=tls)


def start_lean_upstream(work: Path) -> tuple[subprocess.Popen, Path, int, int]:
    """This upstream in a process of its own, on free ports, with certificates made in ``work``:
    (process, the CA its https side is signed by, http port, https port)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from stepmill.children import free_port
    from tests.upstream import make_certs

    ca, cert, key = make_certs(work / "certs")
    http_port, https_port = free_port(), free_port()
    process = subprocess.Popen([sys.executable, "-m", "bench.lean_upstream", "--http-port", str(http_port),
                                "--https-port", str(https_port), "--cert", str(cert), "--key", str(key)], cwd=root)
    return process, ca, http_port, https_port


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--https-port", type=int, required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.005)
    args = parser.parse_args()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(args.cert, args.key)

    async def run():
        await serve("127.0.0.1", args.http_port, events=args.events, delay=args.delay)
        await serve("127.0.0.1", args.https_port, events=args.events, delay=args.delay, tls=tls)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass  # the benchmark stops it with SIGINT


if __name__ == "__main__":
    main()
