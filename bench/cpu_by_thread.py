"""Where a streamed call's CPU goes in `stepmill proxy`, thread by thread, beside a bare mitmdump.

Streamed chat completions against the lean upstream, through each proxy in turn (rounds interleaved,
as the other benchmarks), at one concurrency and scheme; every thread of each proxy's process tree is
read from /proc before and after its cells. The event loop ("python" or "mitmdump": a process's main
thread), stepmill's handoff thread, its writer process and the supervisor show apart, so the difference
to bare mitmdump can be put on a stage.

    .venv/bin/python -m bench.cpu_by_thread                        # http, c=1, about 1 minute
    .venv/bin/python -m bench.cpu_by_thread --scheme https --concurrency 64 --workers 1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shlex
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.idle_rss import command_line, tree
from bench.lean_upstream import start_lean_upstream
from bench.proxy_bench import CLK, Cell, mitm_options, run_cell, stop_all, wait_port
from stepmill.children import free_port
from stepmill.pipeline.handoff import COMMIT_WINDOW
from stepmill.pipeline.writer import SEARCH_WAIT

HERE = Path(__file__).parent
# After each cell, until stepmill's writer has committed and indexed every call of it (its window, then
# the full-text index's wait): all of a cell's CPU falls inside the cell's reading. Bare mitmdump idles.
SETTLE = COMMIT_WINDOW + SEARCH_WAIT + 0.5


def threads(pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(process, thread) -> (a name for it, CPU seconds so far), for the process and its descendants."""
    out = {}
    for process, _ in tree(pid):
        role = command_line(process).split(" -m ", 1)[-1].split()[0].rsplit(".", 1)[-1]
        try:
            tids = [int(t.name) for t in Path(f"/proc/{process}/task").iterdir() if t.name.isdigit()]
        except OSError:
            continue
        for tid in tids:
            try:
                name = Path(f"/proc/{process}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{process}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            what = f"{role}: {'main' if tid == process else name}"
            out[(process, tid)] = (what, (int(fields[11]) + int(fields[12])) / CLK)
    return out


def spent(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds by thread name between two readings (threads of the same name summed)."""
    total = collections.Counter()
    for key, (name, seconds) in after.items():
        total[name] += seconds - before.get(key, (name, 0.0))[1]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", default="http", choices=("http", "https"))
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="per cell and round, at most")
    parser.add_argument("--time-cap", type=float, default=8.0, help="seconds per cell and round, at most")
    parser.add_argument("--stepmill-args", default="", help="more arguments for stepmill proxy")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stepmill-cpu-by-thread-"))
    upstream, ca, http_port, https_port = start_lean_upstream(work)
    confdir = work / "mitm"
    common = mitm_options(confdir, ca)
    bin_dir = Path(sys.executable).parent
    ports = {"mitmdump": free_port(), "stepmill": free_port()}
    commands = {
        "mitmdump": [str(bin_dir / "mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port",
                     str(ports["mitmdump"]), "-s", str(HERE / "stream_passthrough.py"), *common],
        "stepmill": [str(bin_dir / "stepmill"), "proxy", "--workers", str(args.workers), "--host", "127.0.0.1",
                     "--port", str(ports["stepmill"]), "--db", str(work / "steps.db"), "--confdir", str(confdir),
                     *common[2:], *shlex.split(args.stepmill_args)],
    }
    processes = [upstream]
    try:
        wait_port(http_port)
        for name, command in commands.items():  # one after the other: the CA exists after the first start
            processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_port(ports[name])
        pids = {name: proc.pid for name, proc in zip(commands, processes[1:])}
        context = ssl.create_default_context(cafile=str(ca))
        context.load_verify_locations(str(confdir / "mitmproxy-ca-cert.pem"))
        port = http_port if args.scheme == "http" else https_port
        url = f"{args.scheme}://127.0.0.1:{port}/v1/chat/completions"
        cells = {name: Cell(name, "streamed", args.scheme, args.concurrency) for name in commands}
        by_thread = {name: collections.Counter() for name in commands}

        async def rounds():
            await asyncio.sleep(3.0)  # workers and writers up
            for _ in range(args.rounds):
                for name, cell in cells.items():
                    before = threads(pids[name])
                    await run_cell(cell, url, f"http://127.0.0.1:{ports[name]}", context, args.requests, args.time_cap)
                    await asyncio.sleep(SETTLE)  # the writer commits and indexes what the cell sent
                    by_thread[name].update(spent(before, threads(pids[name])))

        asyncio.run(rounds())
        print(f"\n{args.scheme}, c={args.concurrency}, stepmill proxy --workers {args.workers}, "
              f"{args.rounds} rounds interleaved; CPU ms per streamed call\n")
        for name, cell in cells.items():
            calls = len(cell.latencies)
            print(f"{name} ({calls} calls, {cell.errors} errors): "
                  f"{sum(by_thread[name].values()) / calls * 1000:.2f} ms/call in all")
            for thread, seconds in by_thread[name].most_common():
                if seconds:
                    print(f"  {seconds / calls * 1000:6.3f}  {thread}")
        print("\nreproduce: .venv/bin/python -m bench.cpu_by_thread " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    finally:
        stop_all(processes, 30)


if __name__ == "__main__":
    main()
