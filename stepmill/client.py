"""A small client for the control API of a running `stepmill proxy` (standard library only).

    from stepmill.client import StepmillClient
    client = StepmillClient(proxy="http://127.0.0.1:8080")      # through the proxy, no DNS needed
    client = StepmillClient("http://127.0.0.1:8081")            # or directly, on --control-port
    run = client.start_trajectory(group_id="prompt-17")
    client.submit_step(trajectory_id=run["trajectory_id"], prompt_ids=[...], response_ids=[...], logprobs=[...])
    client.complete_trajectory(run["trajectory_id"], reward=1.0)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from stepmill.auth.write_token import read_token

CONTROL_HOST = "http://stepmill.local"


def _q(value: str) -> str:
    """An id as one path segment: spaces, '/', '?', non-ASCII all percent-encoded."""
    return quote(str(value), safe="")


class ControlError(Exception):
    """The control API refused a request; ``status`` and ``message`` say why."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class StepmillClient:
    def __init__(self, base_url: str | None = None, *, proxy: str | None = None, token: str | None = None,
                 confdir: str | None = None, timeout: float = 30.0):
        """``token``: the write token; by default ``STEPMILL_TOKEN``, else the one in ``confdir``
        (mitmproxy's, ~/.mitmproxy) where the proxy on this machine created it."""
        if base_url is None and proxy is None:
            raise ValueError("give the control API's base_url, or the proxy to reach it through")
        self.base_url = (base_url or CONTROL_HOST).rstrip("/")
        self.token = token or read_token(confdir)
        self.timeout = timeout
        handlers = [urllib.request.ProxyHandler({"http": proxy} if proxy else {})]
        self._opener = urllib.request.build_opener(*handlers)

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except (ValueError, AttributeError):
                message = exc.reason
            raise ControlError(exc.code, message) from None

    # -- the API ------------------------------------------------------------------------
    def health(self) -> dict:
        return self.request("GET", "/v1/health")

    def stats(self) -> dict:
        return self.request("GET", "/v1/stats")

    def policy_version(self) -> str | None:
        return self.request("GET", "/v1/policy_version")["policy_version"]

    def set_policy_version(self, version: str | int, *, since: float | None = None) -> str:
        """The version every call that starts from now on (or from ``since``, epoch seconds, already
        past: the moment an engine stopped taking calls for a weight switch) is stamped with."""
        body = {"policy_version": version} if since is None else {"policy_version": version, "since": since}
        return self.request("PUT", "/v1/policy_version", body)["policy_version"]

    def start_trajectory(self, **fields) -> dict:
        """Fields: trajectory_id, group_id, channel, metadata. Returns ids plus proxy_url / base_url."""
        return self.request("POST", "/v1/trajectories", fields)

    def trajectory(self, trajectory_id: str) -> dict:
        return self.request("GET", f"/v1/trajectories/{_q(trajectory_id)}")

    def update_trajectory(self, trajectory_id: str, **fields) -> dict:
        return self.request("PATCH", f"/v1/trajectories/{_q(trajectory_id)}", fields)

    def complete_trajectory(self, trajectory_id: str, reward: float | None = None) -> dict:
        return self.request("POST", f"/v1/trajectories/{_q(trajectory_id)}/complete",
                            {} if reward is None else {"reward": reward})

    def register_run(self, trajectory_id: str, *, door: str | None = None, hosts: list | None = None) -> dict:
        """A fresh secret for the trajectory's run, and its proxy_url / base_url carrying it: from now
        on the proxy records calls into the trajectory only with these credentials. ``door``: the
        loopback address a sandboxed run's calls come from (each of them is then the run's alone);
        ``hosts``: what else than LLM calls it may reach through the proxy."""
        body = {k: v for k, v in (("door", door), ("hosts", hosts)) if v is not None}
        return self.request("POST", f"/v1/trajectories/{_q(trajectory_id)}/credentials", body)

    def revoke_run(self, trajectory_id: str) -> dict:
        """The run ended: its secret writes nothing more (NotFound for a run never registered)."""
        return self.request("DELETE", f"/v1/trajectories/{_q(trajectory_id)}/credentials", {})

    def barrier(self) -> dict:
        """Returns once the writer committed every call the proxy had received (``committed``: false
        if that took longer than the proxy waits)."""
        return self.request("POST", "/v1/barrier", {})

    def submit_step(self, **fields) -> dict:
        """Fields: prompt_ids, response_ids (required), logprobs, reward, trajectory_id, group_id,
        parent_step_id, step_index, policy_version, is_last, metadata, messages, completion, model."""
        return self.request("POST", "/v1/steps", fields)

    def step(self, step_id: str) -> dict:
        return self.request("GET", f"/v1/steps/{_q(step_id)}")

    def reward(self, target: str, value: float, **fields) -> dict:
        """Append a reward to a step, trajectory or upstream response id. Fields: source, name, note,
        details, idempotency_key."""
        return self.request("POST", "/v1/rewards", {"target": target, "value": value, **fields})

    def feedback(self, **fields) -> dict:
        """End-user feedback: one of response_id / step_id / trajectory_id, one of score / thumbs, comment,
        idempotency_key."""
        return self.request("POST", "/v1/feedback", fields)

    def review(self, target: str, action: str, value: str | None = None, *, reviewer: str) -> dict:
        """action: label (good | bad | needs-fix), trainable ("true" | "false"), tag, note."""
        return self.request("POST", "/v1/reviews", {"target": target, "action": action, "value": value,
                                                    "reviewer": reviewer})

    def curation(self, target: str) -> dict:
        return self.request("GET", f"/v1/curation/{_q(target)}")
