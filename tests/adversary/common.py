"""Helpers the adversary scripts share. Standard library only: in user mode the scripts run as
another uid with the system's python3 (the project's interpreter may live where others cannot reach)."""

import base64
import ctypes
import http.client
import json
import os
import sys
import urllib.parse

REPORT = "STEPMILL-ADVERSARY-REPORT "


def attempt(fn, *args, **kwargs) -> dict:
    """What one attempt got: its value, or the exception that stopped it."""
    try:
        return {"ok": True, "value": fn(*args, **kwargs)}
    except BaseException as exc:  # noqa: BLE001 - an adversary records everything
        return {"ok": False, "error": type(exc).__name__, "errno": getattr(exc, "errno", None),
                "message": str(exc)[:400]}


def read_file(path: str) -> dict:
    with open(path, "rb") as handle:
        data = handle.read()
    return {"size": len(data), "text": data[:4000].decode("utf-8", "replace")}


def write_file(path: str, text: str) -> str:
    with open(path, "w") as handle:
        handle.write(text)
    return path


def own_proxy():
    """(host, port, user, password) of the proxy credentials the runner gave this run."""
    url = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy") or os.environ.get("HTTPS_PROXY")
    parts = urllib.parse.urlsplit(url)
    return parts.hostname, parts.port, parts.username, parts.password


def call(method: str, url: str, body=None, *, proxy=None, auth: str | None = None, headers=None,
         timeout: float = 30) -> dict:
    """One HTTP request, redirects not followed: {status, body (JSON or text), location}.
    ``proxy``: (host, port) to send the absolute URL through; ``auth``: "user:password" for it."""
    parts = urllib.parse.urlsplit(url)
    sent = dict(headers or {})
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    if proxy:
        conn = http.client.HTTPConnection(proxy[0], proxy[1], timeout=timeout)
        target = url
        if auth is not None:
            sent["Proxy-Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
    try:
        conn.request(method, target, body=data, headers=sent)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode("utf-8", "replace")[:3000]
    return {"status": response.status, "body": parsed, "location": response.getheader("Location")}


def chat_body(model: str, content: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}]}


def legit_answer(model: str, prompt: str) -> str:
    """The run's honest call: its own credentials, through the proxy, to the configured LLM."""
    host, port, user, secret = own_proxy()
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    answer = call("POST", base + "/chat/completions", chat_body(model, prompt.strip()), proxy=(host, port),
                  auth=f"{user}:{secret}")
    if answer["status"] != 200:
        raise RuntimeError(f"the honest call failed: {answer}")
    return answer["body"]["choices"][0]["message"]["content"]


def processes() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def status_of(pid) -> dict:
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except OSError:
        pass
    return fields


def cmdline(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace")[:300]
    except OSError as exc:
        return f"<{type(exc).__name__}>"


def environ(pid) -> dict:
    """Another process's environment; raises what /proc answers (PermissionError, ...)."""
    with open(f"/proc/{pid}/environ", "rb") as handle:
        raw = handle.read()
    return dict(item.decode("utf-8", "replace").partition("=")[::2] for item in raw.split(b"\0") if item)


LIBC = ctypes.CDLL(None, use_errno=True)


def libc_call(name: str, *args) -> dict:
    result = getattr(LIBC, name)(*args)
    return {"result": result, "errno": ctypes.get_errno() if result != 0 else 0,
            "strerror": os.strerror(ctypes.get_errno()) if result != 0 else ""}


def report(data: dict, tag: str = REPORT) -> None:
    line = tag + json.dumps(data) + "\n"
    os.write(1, line.encode())  # fd 1 is the run's agent.log, whatever sys.stdout was made
    sys.stderr.flush()
