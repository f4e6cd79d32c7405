"""A sandboxed run that tries to leave through its door for somewhere else than its LLM: for each
target in DOOR_TARGETS (host:port of a listener the test keeps on the host's loopback, on [::1], in a
network namespace of its own; and a port where nothing listens) a POST on an LLM path, a POST on an
LLM-looking path under another prefix, a WebSocket upgrade and a CONNECT, all through the proxy with
its own credentials; a request whose Host header names a host of [isolation] allow_hosts while its
URL names the listener; and one to a host:port allow_hosts does name. Then it answers honestly.

    python3 door_reach.py MODEL   (the task on standard input)
"""

import json
import os
import socket
import sys

from common import attempt, call, chat_body, legit_answer, own_proxy, report

E = os.environ


def connect(proxy, target: str) -> dict:
    """CONNECT through the proxy, then a TLS-looking hello of the run's own: what came back."""
    with socket.create_connection(proxy, timeout=15) as conn:
        conn.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                break
            head += data
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        rest = head.partition(b"\r\n\r\n")[2]
        length = [line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
        while length and len(rest) < int(length[0]):
            data = conn.recv(65536)
            if not data:
                break
            rest += data
        if " 200 " in status + " ":
            conn.sendall(b"\x16\x03\x01\x00\x05hello")
            try:
                rest += conn.recv(65536)
            except OSError:
                pass
        return {"status": status, "body": rest.decode("utf-8", "replace")[:2000]}


def websocket(proxy, auth: str, url: str) -> dict:
    headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "c3RlcG1pbGwtZG9vci10ZXN0PT0="}
    return call("GET", url, proxy=proxy, auth=auth, headers=headers, timeout=15)


def main() -> int:
    prompt, model = sys.stdin.read(), sys.argv[1]
    marker = E["INSIDER_MARKER"]
    host, port, user, secret = own_proxy()
    proxy, auth = (host, port), f"{user}:{secret}"
    out = {"trajectory": E["STEPMILL_TRAJECTORY"], "attempts": {}}
    A = out["attempts"]
    for name, target in json.loads(E["DOOR_TARGETS"]).items():
        origin = f"http://{target}"
        A[f"post:{name}"] = attempt(call, "POST", origin + "/v1/chat/completions",
                                    chat_body(model, f"DOOR-REACH-{marker}"), proxy=proxy, auth=auth, timeout=15)
        A[f"prefixed:{name}"] = attempt(call, "POST", origin + "/admin/anything/v1/messages",
                                        chat_body(model, f"DOOR-REACH-{marker}"), proxy=proxy, auth=auth, timeout=15)
        A[f"websocket:{name}"] = attempt(websocket, proxy, auth, origin + "/v1/responses")
        A[f"connect:{name}"] = attempt(connect, proxy, target)
    spoofed, allowed = E["DOOR_SPOOF"], E["DOOR_ALLOWED"]
    A["host_spoof"] = attempt(call, "GET", f"http://{spoofed}/anything", proxy=proxy, auth=auth,
                              headers={"Host": E["DOOR_ALLOWED_NAME"]}, timeout=15)
    A["allowed"] = attempt(call, "GET", f"http://{allowed}/anything", proxy=proxy, auth=auth, timeout=15)
    A["allowed_other_port"] = attempt(call, "GET", f"http://{spoofed}/anything", proxy=proxy, auth=auth, timeout=15)
    out["answer"] = legit_answer(model, prompt)
    report(out)
    print(out["answer"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
