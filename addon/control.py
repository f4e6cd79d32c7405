"""The control API as a mitmproxy addon of its own, on its magic host (as mitmproxy's ``onboarding``).

``request`` only recognises a control call on the event loop: plain ``http://stepmill.local/...``
through the proxy (the host is ``stepmill_control_host``; no DNS needed), or anything on the
``--control-port`` listener. The answer is made in the control thread (``stepmill.api``), so its
reads and writes never hold up the loop; a barrier waits on the loop, without blocking it.

One of several workers (``stepmill proxy --workers N``), the endpoint also answers its siblings on the
private channel (``siblings.py``): a barrier asks every worker for its calls in flight, a registered
run is told to every worker before the registration is answered, health lists every worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import time

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from stepmill.addon.loop_state import LoopState, hook_failed
from stepmill.addon.siblings import Siblings
from stepmill.api.control import ControlAPI, Endpoints
from stepmill.auth.runs import RegisteredRun
from stepmill.auth.write_token import ensure_token
from stepmill.protocols.base import json_bytes

log = logging.getLogger("stepmill")


def hook_failed_quietly(message: str) -> None:
    log.warning(f"stepmill: {message}")

BARRIER_TIMEOUT = 60.0  # seconds a barrier waits for in-flight calls and the writer at most
BARRIER_POLL = 0.02
TELL_TIMEOUT = 5.0  # seconds a sibling has to take a registered run or answer its status


class ControlEndpoint:
    def __init__(self, state: LoopState):
        self.state = state
        self.api: ControlAPI | None = None  # while a pipeline runs: it answers from the pipeline's store
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stepmill-control")
        self.siblings: Siblings | None = None  # the other workers, when this is one of several
        self._add_run = None  # from open: adds a registered run to this worker's table, on the loop
        self._serving: asyncio.Task | None = None

    # -- set-up (``PipelineLifecycle`` opens and closes it with the pipeline) -----------------------
    def open(self) -> None:
        """On the event loop (``running``, or the first request)."""
        state = self.state
        token = ensure_token(ctx.options.confdir)
        self.siblings = Siblings.from_env(token)
        self._add_run = state.on_loop(state.runs.add)
        self.api = ControlAPI(state.pipeline.store, self.endpoints, token=token, status=self._status,
                              on_run=self._on_run)
        if self.siblings is not None:
            self._serving = asyncio.get_running_loop().create_task(self.siblings.serve(
                {"barrier": self._sibling_barrier, "run": self._sibling_run, "status": self._sibling_status}))

    def close(self) -> None:
        self.api = None
        if self.siblings is not None:
            self.siblings.close()
            self.siblings = None

    # -- in the control thread ------------------------------------------------------------------
    def _on_run(self, run: RegisteredRun) -> None:
        """A run registered here: this worker and every sibling check its credentials from the next call,
        whichever worker that call reaches (this loop and the siblings are told before the registration is
        answered)."""
        self._add_run(run)
        siblings = self.siblings
        if siblings is not None:
            for answer in siblings.tell("run", TELL_TIMEOUT, run=dataclasses.asdict(run)):
                if "error" in answer:  # a restarting worker reads every run when it starts
                    hook_failed_quietly(f"a sibling worker was not told of run {run.trajectory_id!r}: {answer}")

    def _status(self) -> dict:
        pipeline, siblings = self.state.pipeline, self.siblings
        out = pipeline.status() if pipeline is not None else {}
        if siblings is not None:
            workers = sorted([self._worker_status()] + siblings.tell("status", TELL_TIMEOUT),
                             key=lambda w: str(w.get("worker")))
            out["workers"] = workers
            out["alive"] = all(worker.get("alive") for worker in workers)  # a worker that did not answer: no
            for count in ("dropped", "not_cleaned"):
                out[f"{count}_all_workers"] = sum(worker.get(count, 0) for worker in workers)
        return out

    def configure(self, updated):
        if "confdir" in updated and self.api is not None:
            self.api.token = ensure_token(ctx.options.confdir)

    def done(self):
        self.thread.shutdown(wait=False)

    def endpoints(self) -> Endpoints:
        """Where agents reach this proxy (for the URLs of a new trajectory): its first listeners."""
        ends = Endpoints()
        for spec in ctx.options.mode:
            try:
                mode = mode_specs.ProxyMode.parse(spec)
            except ValueError:
                continue
            host = mode.listen_host(ctx.options.listen_host) or "127.0.0.1"
            port = mode.listen_port(ctx.options.listen_port)
            url = f"http://{host}:{port}"
            if isinstance(mode, mode_specs.RegularMode) and not ends.proxy:
                ends.proxy = url
            elif isinstance(mode, mode_specs.ReverseMode) and not ends.reverse and not self.is_control_mode(mode):
                ends.reverse = url
        return ends

    @staticmethod
    def is_control_mode(mode) -> bool:
        """The ``--control-port`` listener: a reverse mode to http://<stepmill_control_host>."""
        return isinstance(mode, mode_specs.ReverseMode) and mode.data == f"http://{ctx.options.stepmill_control_host}"

    # -- on the event loop ----------------------------------------------------------------------
    def request(self, flow: http.HTTPFlow):
        """None for every other flow; for a control call, a coroutine (mitmproxy awaits it) that answers."""
        if flow.response is not None:
            return None  # another addon answered already (mitmproxy's proxyauth: 407)
        mode = flow.client_conn.proxy_mode
        if self.is_control_mode(mode) or (  # through the proxy, never on another host or a reverse port:
                isinstance(mode, mode_specs.RegularMode) and flow.request.scheme == "http"
                and flow.request.host == ctx.options.stepmill_control_host):
            return self._answer(flow)
        return None

    async def _answer(self, flow: http.HTTPFlow):
        """Completing a trajectory (and ``POST /v1/barrier``) first waits until every call of the
        trajectory (of all, for the barrier) has ended and the writer committed it."""
        request = flow.request
        api = self.api
        try:
            if api is None:
                raise RuntimeError("stepmill is not running")
            waits = api.barrier_target(request.method, request.path, request.headers.get("authorization"))
            if waits is not False:
                flow.metadata["stepmill_barrier"] = await self._barrier(waits)
            status, payload = await asyncio.get_running_loop().run_in_executor(
                self.thread, lambda: api.handle(request.method, request.path, request.get_content(strict=False) or b"",
                                                authorization=request.headers.get("authorization"),
                                                barrier=flow.metadata.get("stepmill_barrier")))
        except Exception as exc:
            hook_failed("request")
            status, payload = 500, {"error": f"the control API failed: {exc}"}
        flow.response = http.Response.make(status, json_bytes(payload), {"Content-Type": "application/json"})

    async def _barrier(self, trajectory_id: str | None) -> dict:
        """This worker's barrier, and every sibling's at once: committed only when each committed."""
        if self.siblings is None:
            return await self._local_barrier(trajectory_id, time.monotonic() + BARRIER_TIMEOUT)
        started = time.monotonic()
        own, others = await asyncio.gather(
            self._local_barrier(trajectory_id, started + BARRIER_TIMEOUT),
            self.siblings.ask("barrier", BARRIER_TIMEOUT + 5, trajectory=trajectory_id))
        every = [own] + others
        # A worker not started yet has nothing in flight; one that died and did not come back in time
        # may hold calls in its journal: not known committed.
        committed = all(answer.get("committed") or answer.get("absent") for answer in every)
        out = {"committed": committed, "waited_ms": round((time.monotonic() - started) * 1000, 1),
               "workers": len(every)}
        if not committed:
            out["in_flight"] = sum(answer.get("in_flight", 0) for answer in every)
            out["unreachable"] = [answer["worker"] for answer in others if "error" in answer]
        return out

    # -- on the event loop: what siblings ask ----------------------------------------------------
    async def _sibling_barrier(self, message: dict) -> dict:
        return await self._local_barrier(message.get("trajectory"), time.monotonic() + BARRIER_TIMEOUT)

    async def _sibling_run(self, message: dict) -> dict:
        self.state.runs.add(RegisteredRun(**message["run"]))
        return {"ok": True}

    async def _sibling_status(self, message: dict) -> dict:
        return self._worker_status()

    def _worker_status(self) -> dict:
        """What this worker did and whether its threads live, from memory only (no file read: the loop and
        the control thread ask it)."""
        pipeline = self.state.pipeline
        out = {"worker": self.siblings.id if self.siblings else 0, "pid": os.getpid(),
               "in_flight": self.state.in_flight_total(), "alive": False}
        if pipeline is not None:
            out.update(pipeline.threads(), calls=pipeline.submitted, **pipeline.handoff.counts())
        return out

    async def _local_barrier(self, trajectory_id: str | None, deadline: float) -> dict:
        """Waits until no call of ``trajectory_id`` (any call, for None) is in flight, every call handed
        off is in the journal, and the writer committed the journal up to where it then ended."""
        started = time.monotonic()
        state = self.state
        in_flight = state.in_flight_total if trajectory_id is None else lambda: state.in_flight_of(trajectory_id)
        while in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(BARRIER_POLL)
        pipeline = state.pipeline
        committed = pipeline is not None and await pipeline.flushed(deadline, self.thread)
        return {"committed": committed, "waited_ms": round((time.monotonic() - started) * 1000, 1),
                **({} if committed else {"in_flight": in_flight()})}
