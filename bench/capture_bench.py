"""Capture benchmark: proxy overhead, storage per trajectory, read-back speed.

Run from the repository root:  .venv/bin/python -m bench.capture_bench [--calls 200]
Everything runs locally: the test upstream stands in for the LLM, the proxy is `stepmill proxy`.
"""

from __future__ import annotations

import argparse
import sqlite3
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import httpx2
import openai

from stepmill.store import Store
from tests.conftest import start_proxy, stop_proxy
from tests.upstream import Upstream


def timed_calls(client: openai.OpenAI, n: int, stream: bool) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        if stream:
            for _ in client.chat.completions.create(model="bench", stream=True,
                                                    messages=[{"role": "user", "content": f"bench {i} " * 20}]):
                pass
        else:
            client.chat.completions.create(model="bench", messages=[{"role": "user", "content": f"bench {i} " * 20}])
        times.append((time.perf_counter() - start) * 1000)
    return times


def checkpointed(path: Path) -> int:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path.stat().st_size


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--turns", type=int, default=50)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stepmill-bench-"))
    upstream = Upstream(work / "upstream").start()
    proxy = start_proxy(work / "proxy", upstream)
    try:
        context = ssl.create_default_context(cafile=str(upstream.ca))
        direct = openai.OpenAI(api_key="x", base_url=f"https://127.0.0.1:{upstream.port}/v1", max_retries=0,
                               http_client=httpx2.Client(verify=context))
        via = openai.OpenAI(api_key="x", base_url="https://api.openai.com/v1", max_retries=0,
                            http_client=httpx2.Client(proxy=proxy.url, verify=ssl.create_default_context(
                                cafile=proxy.env["SSL_CERT_FILE"])))
        for label, stream in (("plain", False), ("streamed", True)):
            timed_calls(direct, 10, stream), timed_calls(via, 10, stream)  # warm up connections
            d, v = timed_calls(direct, args.calls, stream), timed_calls(via, args.calls, stream)
            print(f"{label:9s} direct p50 {statistics.median(d):6.2f} ms   via stepmill p50 {statistics.median(v):6.2f} ms"
                  f"   p95 {statistics.quantiles(v, n=20)[18]:6.2f} ms   ({args.calls} calls, 2-core machine)")

        # Storage of one long trajectory, each request re-sending the whole history (after the
        # writer has committed the calls above: it commits in batches, off the proxy's loop).
        seen, stable_since = -1, time.time()
        while time.time() - stable_since < 1.0:
            count = Store(proxy.db).stats()["steps"]
            if count != seen:
                seen, stable_since = count, time.time()
            time.sleep(0.1)
        empty = checkpointed(proxy.db)
        before = Store(proxy.db).stats()["steps"]
        messages = [{"role": "system", "content": "You are a careful agent. " * 20}]
        last = 0
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"observation {turn}: " + "tool output line\n" * 40})
            raw = via.chat.completions.with_raw_response.create(model="bench", messages=messages,
                                                                extra_headers={"X-Stepmill-Trajectory": "bench-long"})
            last = len(raw.http_request.content)
            messages.append(raw.parse().choices[0].message.model_dump(exclude_none=True))
        store = Store(proxy.db)
        deadline = time.time() + 30
        while store.stats()["steps"] < before + args.turns and time.time() < deadline:
            time.sleep(0.05)
        grown = checkpointed(proxy.db) - empty
        print(f"storage   {args.turns}-turn trajectory: last request {last} B, database grew {grown} B "
              f"({grown / last:.2f}x the last request)")

        last_step = store.query("SELECT id FROM steps WHERE trajectory_id = 'bench-long' ORDER BY step_index DESC LIMIT 1")[0]["id"]
        cold = Store(proxy.db)
        start = time.perf_counter()
        record = cold.step(last_step)
        print(f"read-back full conversation of step {args.turns} (cold cache): "
              f"{(time.perf_counter() - start) * 1000:.2f} ms, {len(record['messages'])} messages")
        start = time.perf_counter()
        count = sum(1 for _ in Store(proxy.db).iter_steps())
        elapsed = time.perf_counter() - start
        print(f"export    {count} steps in {elapsed:.2f} s ({count / elapsed:.0f} steps/s)")
    finally:
        stop_proxy(proxy)
    print("reproduce: .venv/bin/python -m bench.capture_bench " + f"--calls {args.calls} --turns {args.turns}")


if __name__ == "__main__":
    main()
