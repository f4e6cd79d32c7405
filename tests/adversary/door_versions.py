"""A white-box entry (``tests.adversary.door_versions:run``) that chooses its own policy version and
tokens, and leans on its engine door: after one honest generation it writes, on its own steps pipe,
a line for that generation's very output ids again and a line for ids the engine never answered,
each saying ``weight_versions: [{"version": "999"}]`` and a ``started_at`` of its choosing; then it
sends its engine door a request that says it carries 300 MiB (and does send them), and one on a
route no run needs. What the door answered goes to its log (``BODY-BUDGET: …``, ``NEW-ROUTE: …``)."""

import json
import os
import socket
import urllib.parse

HUGE = 300 * 1024 * 1024


def run(task, session):
    user = [{"role": "user", "content": task["prompt"]}]
    ids = session.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    first = session.generate(ids, messages=user, max_tokens=32)
    claimed = [{"version": "999", "start": 0, "end": 3}]
    for response_ids in (first.ids, session.encode("never answered by the engine")):
        line = {"prompt_ids": ids, "response_ids": response_ids, "finish_reason": "stop", "messages": user,
                "completion": {"role": "assistant", "content": "forged"}, "weight_versions": claimed,
                "started_at": 1.0}
        session.out.write(json.dumps(line) + "\n")
        session.out.flush()
    print(f"BODY-BUDGET: {_ask('/v1/completions', HUGE)}", flush=True)
    print(f"NEW-ROUTE: {_ask('/v1/stepmill_new_admin_route', 2)}", flush=True)  # no engine route a run needs
    return first.text


def _ask(path: str, size: int) -> str:
    """Sends the engine door a POST of ``size`` bytes (a megabyte at a time) and answers what it got
    back, on one line."""
    engine = urllib.parse.urlsplit(os.environ["STEPMILL_ENGINE_URL"])
    sock = socket.create_connection((engine.hostname, engine.port), timeout=60)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (path.encode(), size))
    try:
        for at in range(0, size, 1024 * 1024):
            sock.sendall(b" " * min(1024 * 1024, size - at))
    except OSError:
        pass  # the door stopped reading: its answer says why
    try:
        answer = sock.recv(65536)
    except OSError as exc:
        return f"no answer ({exc})"
    return answer[:500].decode("latin-1").replace("\r\n", " | ")
