"""A CPU load at Linux's idle priority (SCHED_IDLE), the priority stepmill's writer runs at.

The proxy benchmark runs it beside bare mitmdump (``--idle-burner FRACTION``) to show what any
background work on the same machine costs a proxy there, whatever its priority: on a small VM the
cores slow each other (shared physical cores, the hypervisor), which no scheduler policy undoes.
It busy-loops ``fraction`` of every 100 ms, as a writer with that much work per second would.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fraction", type=float, required=True, help="share of one core, 0..1")
    args = parser.parse_args()
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    period = 0.1
    busy = period * min(max(args.fraction, 0.0), 1.0)
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(max(0.0, period - busy))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
