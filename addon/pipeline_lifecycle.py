"""Starts the capture pipeline once mitmproxy runs, restarts it when its options change, stops it at exit.

The pipeline (journal, handoff thread, writer, and the state watch of the runs other processes
register) starts in ``running`` (or at a request that comes first): by then mitmproxy has applied and
checked every option, so a misspelt value fails before any file is touched. Starting is the one time
the loop touches the disk (it opens, and may migrate, the database, makes the journal, starts the
writer and reads the runs), at start-up and again when ``configure`` changes a pipeline option (a
restart: calls wait on the loop meanwhile). Once started, the pipeline runs off the loop; the loop
reaches it through ``LoopState``, and the watch's news reaches the loop through ``LoopState.on_loop``.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx

from stepmill.addon.control import ControlEndpoint
from stepmill.addon.loop_state import LoopState
from stepmill.addon.options import PIPELINE_OPTIONS
from stepmill.auth.runs import RunTable
from stepmill.pipeline.service import Pipeline

log = logging.getLogger("stepmill")


class PipelineLifecycle:
    def __init__(self, state: LoopState, control: ControlEndpoint):
        self.state = state
        self.control = control
        self.stopped = False  # after done: nothing starts again

    def running(self):
        if self.state.pipeline is None:
            self._start()

    def request(self, flow):
        """mitmproxy listens before it sends ``running``: a call in between starts the pipeline (the
        options are final by the time anything listens). One check per request otherwise."""
        if self.state.pipeline is None and not self.stopped:
            self._start()

    def configure(self, updated):
        if self.state.pipeline is not None and updated & PIPELINE_OPTIONS:
            self._stop()
            self._start()

    def done(self):
        self.stopped = True
        self._stop()

    def _start(self) -> None:
        state = self.state
        pipeline = Pipeline(ctx.options.stepmill_db, writer=ctx.options.stepmill_writer,
                            priority=ctx.options.stepmill_writer_priority,
                            durability=ctx.options.stepmill_durability)  # creates or migrates the file
        state.runs = RunTable()
        try:
            pipeline.watch_runs(state.on_loop(state.runs.add))
        except BaseException:  # its writer and handoff run already: the next request starts anew, not beside them
            pipeline.close()
            raise
        state.pipeline = pipeline
        self.control.open()
        log.info(f"stepmill: writing steps to {pipeline.db_path} ({pipeline.writer_kind} writer, "
                 f"journal {pipeline.journal.folder})")

    def _stop(self) -> None:
        self.control.close()
        if self.state.pipeline is not None:
            self.state.pipeline.close()
        self.state.pipeline = None
