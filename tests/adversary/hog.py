"""A run that takes what it can of the machine, chosen by its task (INSIDER_HOG_<task id>):

- ``fork``: starts INSIDER_FORKS processes that sleep (a fork bomb, bounded so the test ends);
- ``memory``: allocates INSIDER_MEGABYTES MiB and touches every page;
- ``flood``: writes INSIDER_FLOOD_MB MiB to standard output;
- ``fill``: answers honestly first (its call is committed), then writes a file in its work folder
  until the disk is full, and leaves it there;
- anything else: answers honestly.

It reports what it got before anything else can stop it (a line per stage), then answers honestly.

    python3 hog.py MODEL   (the task on standard input)
"""

import json
import os
import sys
import time

from common import legit_answer, report

E = os.environ


def fork(count: int) -> dict:
    children, error = [], None
    for _ in range(count):
        try:
            pid = os.fork()
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    return {"started": len(children), "error": error}


def memory(megabytes: int) -> dict:
    held = []
    for index in range(megabytes):
        block = bytearray(2**20)
        block[::4096] = b"x" * len(block[::4096])
        held.append(block)
        if index % 64 == 0:
            report({"trajectory": E["STEPMILL_TRAJECTORY"], "stage": "memory", "megabytes": index})
    return {"megabytes": len(held)}


def flood(megabytes: int) -> dict:
    line = (b"FLOOD " * 170 + b"\n")[:1024]
    for _ in range(megabytes * 1024):
        os.write(1, line)
    return {"megabytes": megabytes}


def fill(model: str, prompt: str) -> dict:
    answer = legit_answer(model, prompt)
    print(answer, flush=True)
    time.sleep(2)  # the proxy commits the call first
    written, error = 0, None
    block = b"F" * 2**20
    try:
        with open("filler.bin", "wb") as handle:
            while written < 2**34:
                handle.write(block)
                handle.flush()
                written += len(block)
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"megabytes": written // 2**20, "error": error, "answer": answer}


def main() -> int:
    prompt, model = sys.stdin.read(), sys.argv[1]
    own = E["STEPMILL_TRAJECTORY"]
    task = next((key[len("INSIDER_HOG_"):] for key in E if key.startswith("INSIDER_HOG_")
                 and f"-{key[len('INSIDER_HOG_'):]}-" in own), None)
    what = E.get(f"INSIDER_HOG_{task}") if task else None
    out = {"trajectory": own, "hog": what}
    report({"trajectory": own, "stage": "start", "hog": what})
    if what == "fork":
        out["got"] = fork(int(E["INSIDER_FORKS"]))
    elif what == "memory":
        out["got"] = memory(int(E["INSIDER_MEGABYTES"]))
    elif what == "flood":
        out["got"] = flood(int(E["INSIDER_FLOOD_MB"]))
    elif what == "fill":
        report({**out, "got": fill(model, prompt)})
        return 0
    report(out)
    answer = legit_answer(model, prompt)
    print(answer)
    report({**out, "answer": answer})
    return 0


if __name__ == "__main__":
    sys.exit(main())
