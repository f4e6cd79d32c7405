"""Clients for `stepmill ui`: the server itself with the sign-in link it prints (``UI``), and a
small Chrome DevTools Protocol client for Debian's chromium (no driver, nothing downloaded).

    with UI(db) as ui:
        status, body, headers = ui.get("/-/stepmill/lifecycle.json")            # signed in (root)
        status, body, headers = ui.get("/-/stepmill/lifecycle.json", anonymous=True)
    with Browser(tmp_path) as browser:
        browser.go("http://127.0.0.1:8001/")
        browser.click("[data-sm=label-bad]")   # and waits for the page it leads to
        html = browser.html()
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium")
STEPMILL = [sys.executable, "-m", "stepmill.cli"]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect is the answer, not followed


class UI:
    """`stepmill ui` started for real; ``get`` is signed in as root (through the one-time link it printed)
    unless ``anonymous``. Redirects are not followed: a 302 and its Location are what comes back."""

    def __init__(self, db: Path | list[Path], *, host: str = "127.0.0.1", env: dict | None = None):
        """``db``: a file, or several (`stepmill ui --db A --db B`); ``env``: more environment (a coordinator)."""
        from stepmill.children import free_port

        self.dbs = db if isinstance(db, list) else [db]
        self.db, self.host, self.port, self.env = self.dbs[0], host, free_port(), env or {}
        self.base = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.link = None
        self.output: list[str] = []
        self._jar = None

    def __enter__(self) -> "UI":
        dbs = [arg for db in self.dbs for arg in ("--db", str(db))]
        self.process = subprocess.Popen(STEPMILL + ["ui", *dbs, "--host", self.host, "--port", str(self.port)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **self.env})
        deadline = time.time() + 60
        while self.link is None:
            line = self.process.stdout.readline()
            if not line and (self.process.poll() is not None or time.time() > deadline):
                raise RuntimeError("stepmill ui printed no sign-in link:\n" + "".join(self.output))
            self.output.append(line)
            found = re.search(r"(http://\S+/-/auth-token\?token=\w+)", line)
            if found:
                self.link = found.group(1)
        threading.Thread(target=lambda: [self.output.append(x) for x in self.process.stdout], daemon=True).start()
        while self.get("/-/static/app.css", anonymous=True)[0] is None:  # it prints the link before it listens
            if time.time() > deadline:
                raise RuntimeError("stepmill ui did not listen:\n" + "".join(self.output))
            time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(15)

    def opener(self, jar=None):
        handlers = [urllib.request.ProxyHandler({}), _NoRedirect()]
        if jar is not None:
            handlers.append(urllib.request.HTTPCookieProcessor(jar))
        return urllib.request.build_opener(*handlers)

    def sign_in(self, link: str) -> http.cookiejar.CookieJar:
        """The cookies a sign-in link (root's or a reviewer's) gives."""
        jar = http.cookiejar.CookieJar()
        status, _, _ = self.get(link.replace(link.split("/-/")[0], self.base), jar=jar)
        assert status == 302 and jar, f"signing in with {link} gave {status}"
        return jar

    def get(self, path: str, *, anonymous: bool = False, jar=None, data: bytes | None = None):
        """(status, body text, headers); status None when nothing listens."""
        if not anonymous and jar is None:
            if self._jar is None:
                self._jar = self.sign_in(self.link)
            jar = self._jar
        url = path if path.startswith("http") else self.base + path
        try:
            with self.opener(jar).open(urllib.request.Request(url, data=data), timeout=15) as response:
                return response.status, response.read().decode("utf-8", "replace"), response.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace"), exc.headers
        except OSError:
            return None, "", {}


class Browser:
    def __init__(self, folder: Path):
        self.folder = folder
        self.process = None
        self.ws = None
        self.next_id = 0

    def __enter__(self) -> "Browser":
        profile = self.folder / "chromium-profile"
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
             "--disable-background-networking", "--disable-component-update", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.time() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.time() > deadline:
                raise RuntimeError("chromium did not start")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None)
        self.send("Page.enable")
        self.send("Runtime.enable")
        return self

    def __exit__(self, *exc):
        if self.ws is not None:
            self.ws.close()
        self.process.terminate()
        self.process.wait(15)

    def send(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def _wait_load(self) -> None:
        deadline = time.time() + 30
        while time.time() < deadline:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("method") == "Page.loadEventFired":
                return
        raise TimeoutError("the page did not load")

    def go(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self._wait_load()

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if result.get("exceptionDetails"):
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """Click the element (a submit button) and wait for the page it leads to."""
        found = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                              " if (!e) return false; e.click(); return true; })()")
        if not found:
            raise AssertionError(f"no element {selector} on {self.evaluate('location.href')}")
        self._wait_load()

    def fill(self, selector: str, value: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).value = {json.dumps(value)}")

    def html(self) -> str:
        return self.evaluate("document.documentElement.outerHTML")

    def screenshot(self, path: Path, *, full_page: bool = False) -> None:
        import base64

        params = {"format": "png"}
        if full_page:  # the whole page, not only the viewport
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"],
                                                              "height": min(size["height"], 6000), "scale": 1})
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", **params)["data"]))

    def sign_in_as(self, ui: "UI") -> None:
        """The cookies ``ui.get`` is signed in with, given to the browser (root's link works only once)."""
        if ui._jar is None:
            ui._jar = ui.sign_in(ui.link)
        for cookie in ui._jar:
            self.send("Network.setCookie", name=cookie.name, value=cookie.value, url=ui.base)

    def viewport(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def wait_for(self, expression: str, timeout: float = 30.0):
        """Poll a JavaScript expression until it is truthy (the page is not reloaded); returns its value."""
        deadline = time.time() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            time.sleep(0.2)
