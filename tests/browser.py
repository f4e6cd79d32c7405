"""A small Chrome DevTools Protocol client for Debian's chromium (no driver, nothing downloaded).

    with Browser(tmp_path) as browser:
        browser.go("http://127.0.0.1:8001/")
        browser.click("[data-sm=label-bad]")   # and waits for the page it leads to
        html = browser.html()
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium")


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

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
