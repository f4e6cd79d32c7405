"""`stepmill proxy --workers N` against N, side by side with bare mitmdump, in one run.

Configurations: ``mitmdump`` (bare, with the SSE passthrough addon: the fair baseline), and
``stepmill-wN`` (``stepmill proxy --workers N``, capture on) for N = 1, 2 and 4 where the machine
has 4 cores (``--workers``). Workloads: ``plain`` and ``streamed`` chat completions against the lean
upstream (``bench/lean_upstream.py``), through the proxy as agents go (https: CONNECT + TLS
interception), at one concurrency. Cells run in rounds, interleaved, so machine noise hits every
configuration alike.

Reported per cell: requests/s, its ratio to one worker, latency p50/p99, and CPU milliseconds per
request of the proxy's event loops (every worker), of all its processes (the writers too), and of
the load generator (this process): on a machine with few cores, the generator competes with the
workers for the same cores, and its share is what the workers cannot have.

    .venv/bin/python -m bench.workers_bench            # about 2 minutes
    .venv/bin/python -m bench.workers_bench --quick    # about 1 minute
    .venv/bin/python -m bench.workers_bench --workers 1,2,4,8 --concurrency 128 --scheme http
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lean_upstream import start_lean_upstream
from bench.proxy_bench import Cell, children, cpu, mitm_options, pct, run_cell, stop_all, tree_cpu, wait_port
from stepmill.children import free_port

HERE = Path(__file__).parent


def loops_cpu(config: str, pid: int) -> float:
    """CPU seconds of the event loops: the supervisor's workers (their writers not counted), or the
    process itself (one worker, bare mitmdump)."""
    if config.startswith("stepmill-w") and config != "stepmill-w1":
        return sum(cpu(worker) for worker in children(pid))
    return cpu(pid)


def machine_busy() -> float:
    """CPU seconds every process on the machine spent so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--workers", default="1,2" + (",4" if cores >= 4 else ""))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workloads", default="plain,streamed")
    parser.add_argument("--scheme", default="https", choices=("http", "https"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500, help="per cell and round, at most")
    parser.add_argument("--time-cap", type=float, default=5.0, help="seconds per cell and round, at most")
    parser.add_argument("--quick", action="store_true", help="two rounds, shorter cells")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.time_cap = 2, 3.0
    counts = [int(n) for n in args.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="stepmill-workers-bench-"))
    upstream, ca, http_port, https_port = start_lean_upstream(work)
    processes = [upstream]
    confdir = work / "mitm"
    common = mitm_options(confdir, ca)
    bin_dir = Path(sys.executable).parent
    configs = ["mitmdump"] + [f"stepmill-w{n}" for n in counts]
    ports = {name: free_port() for name in configs}
    commands = {"mitmdump": [str(bin_dir / "mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port",
                             str(ports["mitmdump"]), "-s", str(HERE / "stream_passthrough.py"), *common]}
    for n in counts:
        name = f"stepmill-w{n}"
        commands[name] = [str(bin_dir / "stepmill"), "proxy", "--workers", str(n), "--host", "127.0.0.1",
                          "--port", str(ports[name]), "--db", str(work / f"{name}.db"), "--confdir", str(confdir),
                          *common[2:]]
    pids = {}
    try:
        wait_port(http_port)
        for name in configs:  # one after the other: the CA exists after the first start
            proc = subprocess.Popen(commands[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(proc)
            pids[name] = proc.pid
            wait_port(ports[name])
        time.sleep(3.0)  # every worker listening
        context = ssl.create_default_context(cafile=str(ca))
        context.load_verify_locations(str(confdir / "mitmproxy-ca-cert.pem"))
        cells = [Cell(config, workload, args.scheme, args.concurrency)
                 for workload in args.workloads.split(",") for config in configs]
        client_cpu = {id(cell): 0.0 for cell in cells}
        upstream_cpu = {id(cell): 0.0 for cell in cells}
        busy = {id(cell): 0.0 for cell in cells}
        port = http_port if args.scheme == "http" else https_port
        url = f"{args.scheme}://127.0.0.1:{port}/v1/chat/completions"

        async def all_rounds():
            for _ in range(args.rounds):
                for cell in cells:
                    pid = pids[cell.config]
                    before = (loops_cpu(cell.config, pid), tree_cpu(pid), own_cpu(), cpu(processes[0].pid),
                              machine_busy())
                    await run_cell(cell, url, f"http://127.0.0.1:{ports[cell.config]}", context, args.requests,
                                   args.time_cap)
                    cell.cpu_main += loops_cpu(cell.config, pid) - before[0]
                    cell.cpu_all += tree_cpu(pid) - before[1]
                    client_cpu[id(cell)] += own_cpu() - before[2]
                    upstream_cpu[id(cell)] += cpu(processes[0].pid) - before[3]
                    busy[id(cell)] += machine_busy() - before[4]

        asyncio.run(all_rounds())
        report(cells, client_cpu, upstream_cpu, busy, cores, args)
    finally:
        stop_all(processes, 30)


def report(cells: list[Cell], client_cpu: dict, upstream_cpu: dict, busy: dict, cores: int, args) -> None:
    def rps(cell: Cell) -> float:
        return len(cell.latencies) / cell.seconds if cell.seconds else 0.0

    def others(cell: Cell) -> float:
        """Cores busy with processes outside this benchmark during the cell."""
        ours = cell.cpu_all + client_cpu[id(cell)] + upstream_cpu[id(cell)]
        return max(0.0, busy[id(cell)] - ours) / cell.seconds if cell.seconds else 0.0

    by_key = {(c.config, c.workload): c for c in cells}
    print(f"\n{cores} cores; {args.scheme}, c={args.concurrency}, {args.rounds} rounds interleaved\n")
    print("| workload | config | req/s | ×1 worker | ×mitmdump | p50 ms | p99 ms | event loops CPU ms/req | "
          "all proxy processes CPU ms/req | load generator CPU ms/req | upstream CPU ms/req | machine busy | "
          "others' CPU (cores) | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        n = len(cell.latencies)
        one = by_key.get(("stepmill-w1", cell.workload))
        base = by_key.get(("mitmdump", cell.workload))
        scale = f"{rps(cell) / rps(one):.2f}" if one and rps(one) and cell.config.startswith("stepmill") else "–"
        ratio = f"{rps(cell) / rps(base):.2f}" if base and rps(base) else "–"
        per = (lambda seconds: f"{seconds / n * 1000:.2f}") if n else (lambda seconds: "–")
        print(f"| {cell.workload} | {cell.config} | {rps(cell):.0f} | {scale} | {ratio} | {pct(cell.latencies, 0.5):.1f}"
              f" | {pct(cell.latencies, 0.99):.1f} | {per(cell.cpu_main)} | {per(cell.cpu_all)} | "
              f"{per(client_cpu[id(cell)])} | {per(upstream_cpu[id(cell)])} | "
              f"{busy[id(cell)] / cell.seconds / cores:.0%} | {others(cell):.2f} | {cell.errors} |")
    print()
    for workload in args.workloads.split(","):
        one = by_key.get(("stepmill-w1", workload))
        if not one or not one.latencies:
            continue
        loop_ms = one.cpu_main / len(one.latencies) * 1000
        all_ms = one.cpu_all / len(one.latencies) * 1000
        client_ms = client_cpu[id(one)] / len(one.latencies) * 1000
        upstream_ms = upstream_cpu[id(one)] / len(one.latencies) * 1000
        print(f"{workload}: one worker costs {loop_ms:.2f} ms of CPU per request on its event loop ({all_ms:.2f} ms "
              f"with its writer): a worker given a core of its own serves up to ~{1000 / loop_ms:.0f} req/s, so on a "
              f"larger machine N workers (N ≤ free cores, the load elsewhere) should give ~N × {1000 / loop_ms:.0f} "
              f"req/s until the one SQLite writer lock or the upstream binds. Here the load generator itself spends "
              f"{client_ms:.2f} ms per request and the upstream {upstream_ms:.2f} ms: "
              f"{(client_ms + upstream_ms) / (client_ms + upstream_ms + all_ms):.0%} of the CPU of a call on {cores} "
              f"shared cores, which the workers cannot have; 2 workers can reach 2x one worker only where one worker "
              f"leaves a core idle.")
    print("\nreproduce: .venv/bin/python -m bench.workers_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


if __name__ == "__main__":
    main()
