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
    .venv/bin/python -m bench.proxy_bench --variant thread="--set stepmill_writer=thread"

``--variant NAME=ARGS`` (repeatable) adds another ``stepmill proxy`` with more arguments as a
configuration of its own, interleaved with the others in the same run: the way to compare two
settings when run-to-run noise is larger than their difference.

``--idle-burner FRACTION`` adds ``mitmdump+idle``: bare mitmdump while a process at idle CPU
priority (``bench/idle_burner.py``) busy-loops that share of a core, as stepmill's writer does
beside stepmill. On a machine whose cores slow each other, it shows what such background work
costs any proxy, stepmill's design aside.

``--again`` adds ``mitmdump-again``: the same bare mitmdump measured as a configuration of its
own (an A/A control). How far it lands from ``mitmdump`` is the run's noise: a difference between
stepmill and mitmdump smaller than that is not one this machine can show.
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

from bench.lean_upstream import start_lean_upstream
from stepmill.children import free_port
from stepmill.client import StepmillClient

HERE = Path(__file__).parent
CLK = os.sysconf("SC_CLK_TCK")


def mitm_options(confdir: Path, ca: Path) -> list[str]:
    """What every proxy under test is given: its confdir, trust in the lean upstream's CA, lazy connects."""
    return ["--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={ca}",
            "--set", "connection_strategy=lazy"]


def stop_all(processes: list[subprocess.Popen], wait: float) -> None:
    """SIGINT to each (the last started first), then each gets ``wait`` seconds before SIGKILL."""
    for proc in reversed(processes):
        proc.send_signal(signal.SIGINT)
    for proc in processes:
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    body = {"stream": True} if cell.workload == "streamed" else {}
    body.update(model="bench", messages=[{"role": "user", "content": "benchmark " * 40}])
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


def rss_mib(pid: int) -> float:
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


async def slow_streams(url: str, proxy: str, context, pid: int, count: int) -> dict:
    """``count`` streams open at once, 5 events 1 s apart: memory per stream and CPU."""
    connector = aiohttp.TCPConnector(limit=count, ssl=context)
    before_rss, before_cpu = rss_mib(pid), tree_cpu(pid)
    peak = [before_rss]

    async def one(session):
        async with session.post(url, proxy=proxy, headers={"x-bench-events": "5", "x-bench-delay": "1"},
                                json={"stream": True, "model": "bench", "messages": [{"role": "user", "content": "slow"}]}) as r:
            async for _ in r.content.iter_any():
                pass

    async def watch():
        while True:
            peak[0] = max(peak[0], rss_mib(pid))
            await asyncio.sleep(0.25)

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*(one(session) for _ in range(count)), return_exceptions=True)
        watcher.cancel()
    errors = sum(isinstance(r, Exception) for r in results)
    return {"streams": count, "errors": errors, "peak_rss_mib": round(peak[0], 1),
            "kib_per_stream": round((peak[0] - before_rss) * 1024 / count, 1),
            "cpu_ms_per_stream": round((tree_cpu(pid) - before_cpu) * 1000 / count, 2)}


async def big_body(url: str, proxy: str, context, pid: int, megabytes: int) -> dict:
    """One request with a huge body while streams flow: how much it delays them, and memory."""
    connector = aiohttp.TCPConnector(limit=32, ssl=context)
    ttfts: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def streams(session):
        while not stop.is_set():
            start = time.perf_counter()
            async with session.post(url, proxy=proxy, json={"stream": True, "model": "bench", "messages": [
                    {"role": "user", "content": "small"}]}) as r:
                first = None
                async for _ in r.content.iter_any():
                    first = first or time.perf_counter()
            ttfts.append((start, (first - start) * 1000))

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        workers = [asyncio.ensure_future(streams(session)) for _ in range(8)]
        await asyncio.sleep(1.5)
        before_rss = rss_mib(pid)
        sent = time.perf_counter()
        payload = {"model": "bench", "messages": [{"role": "user", "content": "x" * (megabytes * 1024 * 1024)}]}
        async with session.post(url, proxy=proxy, json=payload) as r:
            await r.read()
        done = time.perf_counter()
        peak_after = rss_mib(pid)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
    quiet = [t for at, t in ttfts if at < sent]
    during = [t for at, t in ttfts if sent <= at <= done + 0.5]
    return {"body_mib": megabytes, "ttft_p50_before_ms": round(statistics.median(quiet), 1) if quiet else None,
            "ttft_max_during_ms": round(max(during), 1) if during else None,
            "rss_before_mib": round(before_rss, 1), "rss_after_call_mib": round(peak_after, 1),
            "rss_3s_later_mib": round(rss_mib(pid), 1)}


def health(port: int, confdir: Path) -> dict:
    """stepmill's capture state, from its control API through the proxy (with the token it made in
    ``confdir``: an anonymous caller learns only whether it is ok)."""
    client = StepmillClient(proxy=f"http://127.0.0.1:{port}", confdir=str(confdir), timeout=10)
    return client.health()["capture"]


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
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="another `stepmill proxy` configuration, with these more arguments (repeatable)")
    parser.add_argument("--idle-burner", type=float, default=0.0, metavar="FRACTION",
                        help="also run bare mitmdump beside an idle-priority CPU load of this share of a core")
    parser.add_argument("--again", action="store_true",
                        help="also measure bare mitmdump a second time, as its own configuration (A/A control)")
    parser.add_argument("--slow-streams", type=int, default=1000, help="streams open at once (0: skip)")
    parser.add_argument("--big-body", type=int, default=50, help="MiB of one request body (0: skip)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.schemes = 1, 150, "https"
    work = Path(tempfile.mkdtemp(prefix="stepmill-proxy-bench-"))
    upstream, ca, http_port, https_port = start_lean_upstream(work)
    processes = [upstream]
    confdir = work / "mitm"
    common = mitm_options(confdir, ca)
    bin_dir = Path(sys.executable).parent
    stepmill_configs = {"stepmill": shlex.split(args.stepmill_args)}
    for variant in args.variant:
        name, sep, more = variant.partition("=")
        if not sep or not name or name in ("direct", "mitmdump", "stepmill"):
            parser.error(f"--variant takes NAME=ARGS with a new name, not {variant!r}")
        stepmill_configs[name] = shlex.split(args.stepmill_args) + shlex.split(more)
    ports = {name: free_port() for name in ("mitmdump", *stepmill_configs)}
    commands = {"mitmdump": [str(bin_dir / "mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port",
                             str(ports["mitmdump"]), "-s", str(HERE / "stream_passthrough.py"), *common]}
    for name, more in stepmill_configs.items():
        commands[name] = [str(bin_dir / "stepmill"), "proxy", "--host", "127.0.0.1", "--port", str(ports[name]),
                          "--db", str(work / f"{name}.db"), "--confdir", str(confdir), *common[2:], *more]
    pids = {}
    try:
        wait_port(http_port)
        for name in commands:  # the CA exists after the first start
            proc = subprocess.Popen(commands[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(proc)
            pids[name] = proc.pid
            wait_port(ports[name])
        time.sleep(1.0)
        context = ssl.create_default_context(cafile=str(ca))
        context.load_verify_locations(str(confdir / "mitmproxy-ca-cert.pem"))
        configs = ["direct", *commands] + (["mitmdump+idle"] if args.idle_burner else []) \
            + (["mitmdump-again"] if args.again else [])
        cells = [Cell(config, workload, scheme, int(c))
                 for c in args.concurrency.split(",") for workload in args.workloads.split(",")
                 for scheme in args.schemes.split(",") for config in configs]
        for alias in ("mitmdump+idle", "mitmdump-again"):
            ports[alias], pids[alias] = ports["mitmdump"], pids["mitmdump"]

        async def all_rounds():
            for _ in range(args.rounds):
                for cell in cells:
                    port = http_port if cell.scheme == "http" else https_port
                    url = f"{cell.scheme}://127.0.0.1:{port}/v1/chat/completions"
                    proxy = None if cell.config == "direct" else f"http://127.0.0.1:{ports[cell.config]}"
                    pid = pids.get(cell.config)
                    before = (cpu(pid), tree_cpu(pid)) if pid else (0, 0)
                    burner = subprocess.Popen([sys.executable, "-m", "bench.idle_burner", "--fraction",
                                               str(args.idle_burner)], cwd=HERE.parent) \
                        if cell.config == "mitmdump+idle" else None
                    try:
                        await run_cell(cell, url, proxy, context, args.requests, args.time_cap)
                    finally:
                        if burner is not None:
                            burner.kill()
                            burner.wait()
                    if pid:
                        cell.cpu_main += cpu(pid) - before[0]
                        cell.cpu_all += tree_cpu(pid) - before[1]

        asyncio.run(all_rounds())
        report(cells, args)
        url = f"https://127.0.0.1:{https_port}/v1/chat/completions"
        for name in ("mitmdump", "stepmill"):
            proxy = f"http://127.0.0.1:{ports[name]}"
            if args.slow_streams:
                print(f"{name}: slow streams", asyncio.run(slow_streams(url, proxy, context, pids[name],
                                                                        args.slow_streams)))
            if args.big_body:
                print(f"{name}: big body", asyncio.run(big_body(url, proxy, context, pids[name], args.big_body)))
        for name in stepmill_configs:  # the last 1,000 calls of each (a variant's durability shows here)
            capture = health(ports[name], confdir)
            print(f"{name}: call end → journal {capture['journal_delay_ms']} ms, "
                  f"{capture['journaled']} calls journaled, {capture['dropped']} dropped, "
                  f"{capture['uncommitted_bytes']} journal bytes not yet in SQLite when the load stopped")
        stopped = time.time()
        while health(ports["stepmill"], confdir)["uncommitted_bytes"] and time.time() - stopped < 120:
            time.sleep(0.05)
        print(f"stepmill: everything committed {time.time() - stopped:.2f} s after the load stopped")
    finally:
        stop_all(processes, 15)


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
    shares = {f"{c.workload} {c.scheme} c={c.concurrency}": (c.cpu_all - c.cpu_main) / c.seconds
              for c in cells if c.config == "stepmill" and c.seconds}
    if shares:
        print("\nstepmill's other processes (the writer), share of one core during the cells: "
              + ", ".join(f"{name} {share:.0%}" for name, share in shares.items()))
    print("\nreproduce: .venv/bin/python -m bench.proxy_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


if __name__ == "__main__":
    main()
