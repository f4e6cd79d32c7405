"""What an idle `stepmill proxy` holds in memory and spends in CPU, process by process, beside a bare
mitmdump.

Both are started the same way (same confdir, loopback, a free port), left to settle, and every
process of each tree is read from /proc (VmRSS: resident memory, shared pages counted in each
process, as `ps` shows it; CPU time over ``--cpu-window`` seconds of idling). The sum over the tree
is what the proxy costs a machine idle; idle CPU is also part of what each call costs at low load.

    .venv/bin/python -m bench.idle_rss                 # stepmill proxy --workers 2
    .venv/bin/python -m bench.idle_rss --workers 1 --settle 10
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.proxy_bench import children, cpu, stop_all, wait_port
from stepmill.children import free_port


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def command_line(pid: int) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return "?"
    text = " ".join(Path(w.decode()).name if i == 0 else w.decode() for i, w in enumerate(words))
    return text if len(text) <= 90 else text[:87] + "..."


def tree(pid: int, depth: int = 0) -> list[tuple[int, int]]:
    """(pid, depth) for the process and every descendant, parents first."""
    out = [(pid, depth)]
    for child in sorted(children(pid)):
        out += tree(child, depth + 1)
    return out


def wait_settled(pids: list[int], quiet: float, timeout: float = 120.0) -> None:
    """Until the trees' memory has stayed put for ``quiet`` seconds: workers and writers start after
    the port answers, and import for a while."""
    def total() -> float:
        return sum(rss_mib(process) for pid in pids for process, _ in tree(pid))

    deadline, last, since = time.monotonic() + timeout, total(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.5)
        now = total()
        if abs(now - last) > 1.0:
            last, since = now, time.monotonic()


def report(name: str, pid: int, idle_cpu: dict[int, float], window: float) -> float:
    total, total_cpu = 0.0, 0.0
    print(f"\n{name}:")
    for process, depth in tree(pid):
        mib, ms = rss_mib(process), idle_cpu.get(process, 0.0) / window * 1000
        total, total_cpu = total + mib, total_cpu + ms
        print(f"  {mib:7.1f} MiB  {ms:6.2f} ms CPU/s  {'  ' * depth}{command_line(process)}")
    print(f"  {total:7.1f} MiB  {total_cpu:6.2f} ms CPU/s  total")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpu-window", type=float, default=10.0, help="seconds of idling whose CPU time is counted")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds every tree's memory must stay within 1 MiB before it is read")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stepmill-idle-rss-"))
    bin_dir = Path(sys.executable).parent
    ports = {"mitmdump": free_port(), "stepmill": free_port()}
    confdir = work / "mitm"
    commands = {
        "mitmdump": [str(bin_dir / "mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port",
                     str(ports["mitmdump"]), "--set", f"confdir={confdir}"],
        "stepmill": [str(bin_dir / "stepmill"), "proxy", "--workers", str(args.workers), "--host", "127.0.0.1",
                     "--port", str(ports["stepmill"]), "--db", str(work / "idle.db"), "--confdir", str(confdir)],
    }
    processes = []
    try:
        for name, command in commands.items():  # one after the other: the CA exists after the first start
            processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_port(ports[name])
        wait_settled([proc.pid for proc in processes], args.settle)
        every = [process for proc in processes for process, _ in tree(proc.pid)]
        before = {process: cpu(process) for process in every}
        time.sleep(args.cpu_window)
        idle_cpu = {process: cpu(process) - before[process] for process in every}
        totals = {name: report(" ".join(shlex.quote(a) for a in commands[name][:4]) + " …", proc.pid, idle_cpu,
                               args.cpu_window)
                  for name, proc in zip(commands, processes)}
        print(f"\nstepmill proxy --workers {args.workers}: {totals['stepmill']:.0f} MiB, "
              f"{totals['stepmill'] / totals['mitmdump']:.1f}x bare mitmdump's {totals['mitmdump']:.0f} MiB")
        print("reproduce: .venv/bin/python -m bench.idle_rss " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    finally:
        stop_all(processes, 30)


if __name__ == "__main__":
    main()
