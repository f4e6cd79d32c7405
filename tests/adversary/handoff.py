"""Two runs hand credentials over loopback: the giver (task INSIDER_GIVE_ON) serves its proxy URL, with
its secret, on 127.0.0.1:INSIDER_HANDOFF_PORT and ends; the taker fetches it, waits until the giver's run
is over (INSIDER_LATE_AFTER seconds), and calls the LLM as the giver. Both answer honestly too.

    python3 handoff.py MODEL   (the task on standard input)
"""

import json
import os
import socket
import sys
import time

from common import attempt, call, chat_body, legit_answer, own_proxy, report

E = os.environ


def give(port: int, wait: float) -> dict:
    with socket.create_server(("127.0.0.1", port)) as server:
        server.settimeout(wait)
        conn, _ = server.accept()
        with conn:
            conn.sendall(json.dumps({"proxy": E["HTTP_PROXY"]}).encode())
    return {"given": True}


def take(port: int, wait: float) -> dict:
    deadline = time.time() + wait
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
                return json.loads(conn.makefile("rb").read())
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def main() -> int:
    prompt, model = sys.stdin.read(), sys.argv[1]
    own = E["STEPMILL_TRAJECTORY"]
    port = int(E["INSIDER_HANDOFF_PORT"])
    out = {"trajectory": own, "attempts": {}}
    out["answer"] = legit_answer(model, prompt)
    if f"-{E['INSIDER_GIVE_ON']}-" in own:
        out["attempts"]["give"] = attempt(give, port, float(E.get("INSIDER_GIVE_WAIT", "30")))
    else:
        got = out["attempts"]["take"] = attempt(take, port, 30)
        if got["ok"]:
            time.sleep(float(E.get("INSIDER_LATE_AFTER", "4")))
            import urllib.parse
            parts = urllib.parse.urlsplit(got["value"]["proxy"])
            base = E["OPENAI_BASE_URL"].rstrip("/")
            out["attempts"]["late_call"] = attempt(
                call, "POST", base + "/chat/completions",
                chat_body(model, f"LATE-HANDOFF-{E['INSIDER_MARKER']}: {prompt.strip()}"),
                proxy=(parts.hostname, parts.port), auth=f"{parts.username}:{parts.password}")
    report(out)
    print(out["answer"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
