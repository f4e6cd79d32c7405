"""What stepmill costs in front of an LLM API, side by side with bare mitmproxy, in one run.

Configurations: ``direct`` (client → upstream), ``mitmdump`` (bare mitmdump with an SSE
passthrough addon, the fair baseline: without it mitmproxy buffers streams), ``stepmill``
(``stepmill proxy``, capture on). Workloads: ``plain`` and ``streamed`` chat completions (20
events 5 ms apart), over ``http`` and ``https`` (CONNECT + TLS interception), at each
concurrency. Cells run in rounds, interleaved, so machine noise hits every configuration alike.

Reported per cell: requests/s, latency p50/p99, time to first token p50 (streamed), and CPU per
request of the proxy's main process (the event loop every agent's bytes go through) and of all
its processes (stepmill's writer included).

    .venv/bin/python -m bench.proxy_bench                       # about 3 minutes
    .venv/bin/python -m bench.proxy_bench --quick               # about 1 minute
    .venv/bin/python -m bench.proxy_bench --stepmill-args "--set stepmill_writer=thread"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).parent
CLK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK


def tree_cpu(pid: int) -> float:
    return cpu(pid) + sum(tree_cpu(child) for child in children(pid))


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


class Cell:
    def __init__(self, config, workload, scheme, concurrency):
        self.config, self.workload, self.scheme, self.concurrency = config, workload, scheme, concurrency
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.errors = 0
        self.seconds = 0.0
        self.cpu_main = 0.0
        self.cpu_all = 0.0


async def run_cell(cell: Cell, url: str, proxy: str | None, context: ssl.SSLContext, requests: int,
                   time_cap: float) -> None:
    body = {"model": "bench", "messages": [{"role": "user", "content": "benchmark " * 40}]}
    if cell.workload == "streamed":
        body["stream"] = True
    connector = aiohttp.TCPConnector(limit=cell.concurrency, ssl=context)
    remaining = [requests]
    deadline = time.perf_counter() + time_cap

    async def worker(session):
        while remaining[0] > 0 and time.perf_counter() < deadline:
            remaining[0] -= 1
            start = time.perf_counter()
            try:
                async with session.post(url, json=body, proxy=proxy) as response:
                    if cell.workload == "streamed":
                        first = None
                        async for _ in response.content.iter_any():
                            if first is None:
                                first = time.perf_counter()
                        cell.ttfts.append((first - start) * 1000)
                    else:
                        await response.read()
                    if response.status != 200:
                        cell.errors += 1
            except Exception:
                cell.errors += 1
                continue
            cell.latencies.append((time.perf_counter() - start) * 1000)

    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(cell.concurrency)))
        cell.seconds += time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--workloads", default="plain,streamed")
    parser.add_argument("--schemes", default="http,https")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="per cell and round, at most")
    parser.add_argument("--time-cap", type=float, default=4.0, help="seconds per cell and round, at most")
    parser.add_argument("--quick", action="store_true", help="one round, fewer requests, https only")
    parser.add_argument("--stepmill-args", default="", help="more arguments for `stepmill proxy`")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.schemes = 1, 150, "https"
    work = Path(tempfile.mkdtemp(prefix="stepmill-proxy-bench-"))
    sys.path.insert(0, str(HERE.parent))
    from tests.upstream import make_certs

    ca, cert, key = make_certs(work / "certs")
    http_port, https_port = free_port(), free_port()
    processes = [subprocess.Popen([sys.executable, "-m", "bench.lean_upstream", "--http-port", str(http_port),
                                   "--https-port", str(https_port), "--cert", str(cert), "--key", str(key)],
                                  cwd=HERE.parent)]
    confdir = work / "mitm"
    common = ["--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={ca}",
              "--set", "connection_strategy=lazy"]
    bin_dir = Path(sys.executable).parent
    ports = {"mitmdump": free_port(), "stepmill": free_port()}
    commands = {
        "mitmdump": [str(bin_dir / "mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port",
                     str(ports["mitmdump"]), "-s", str(HERE / "stream_passthrough.py"), *common],
        "stepmill": [str(bin_dir / "stepmill"), "proxy", "--host", "127.0.0.1", "--port", str(ports["stepmill"]),
                     "--db", str(work / "bench.db"), "--confdir", str(confdir), *common[2:],
                     *shlex.split(args.stepmill_args)],
    }
    pids = {}
    try:
        wait_port(http_port)
        for name in ("mitmdump", "stepmill"):  # the CA exists after the first start
            proc = subprocess.Popen(commands[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(proc)
            pids[name] = proc.pid
            wait_port(ports[name])
        time.sleep(1.0)
        context = ssl.create_default_context(cafile=str(ca))
        context.load_verify_locations(str(confdir / "mitmproxy-ca-cert.pem"))
        cells = [Cell(config, workload, scheme, int(c))
                 for c in args.concurrency.split(",") for workload in args.workloads.split(",")
                 for scheme in args.schemes.split(",") for config in ("direct", "mitmdump", "stepmill")]

        async def all_rounds():
            for _ in range(args.rounds):
                for cell in cells:
                    port = http_port if cell.scheme == "http" else https_port
                    url = f"{cell.scheme}://127.0.0.1:{port}/v1/chat/completions"
                    proxy = None if cell.config == "direct" else f"http://127.0.0.1:{ports[cell.config]}"
                    pid = pids.get(cell.config)
                    before = (cpu(pid), tree_cpu(pid)) if pid else (0, 0)
                    await run_cell(cell, url, proxy, context, args.requests, args.time_cap)
                    if pid:
                        cell.cpu_main += cpu(pid) - before[0]
                        cell.cpu_all += tree_cpu(pid) - before[1]

        asyncio.run(all_rounds())
        report(cells, args)
    finally:
        for proc in reversed(processes):
            proc.send_signal(signal.SIGINT)
        for proc in processes:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def report(cells: list[Cell], args) -> None:
    by_key = {(c.config, c.workload, c.scheme, c.concurrency): c for c in cells}
    print("| workload | scheme | c | config | req/s | ×mitmdump | p50 ms | p99 ms | TTFT p50 ms | "
          "proxy CPU ms/req (main) | (all processes) | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        n = len(cell.latencies)
        rps = n / cell.seconds if cell.seconds else 0
        base = by_key.get(("mitmdump", cell.workload, cell.scheme, cell.concurrency))
        base_rps = len(base.latencies) / base.seconds if base and base.seconds else 0
        ratio = f"{rps / base_rps:.2f}" if base_rps and cell.config != "direct" else "–"
        ttft = f"{statistics.median(cell.ttfts):.1f}" if cell.ttfts else "–"
        main_cpu = f"{cell.cpu_main / n * 1000:.2f}" if n and cell.config != "direct" else "–"
        all_cpu = f"{cell.cpu_all / n * 1000:.2f}" if n and cell.config != "direct" else "–"
        print(f"| {cell.workload} | {cell.scheme} | {cell.concurrency} | {cell.config} | {rps:.0f} | {ratio} | "
              f"{pct(cell.latencies, 0.5):.1f} | {pct(cell.latencies, 0.99):.1f} | {ttft} | {main_cpu} | {all_cpu} | "
              f"{cell.errors} |")
    print("\nreproduce: .venv/bin/python -m bench.proxy_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


if __name__ == "__main__":
    main()
