"""A rollout's report and its progress line, the same whichever executor runs it (this machine's
``rollout.py``, or a Ray cluster's ``stepmill.fleet.ray_rollout``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Report:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    timed_out: int = 0
    running: int = 0
    left_open: int = 0  # finished, but not every call of theirs could be committed (a full disk): they run again
    unscored: str = ""  # why scoring could not run (a full disk): the same command scores once there is space
    interrupted: bool = False
    isolation: str = ""  # the mode runs used
    trajectories: list = field(default_factory=list)
    shown_at: float = 0.0  # when progress was last written to a log
    nodes: dict = field(default_factory=dict)  # a Ray rollout: node name -> its file, proxy and serve URLs

    def count(self, outcome) -> None:
        self.done += 1
        self.failed += outcome.outcome == "failed"
        self.timed_out += outcome.outcome == "timeout"
        self.left_open += not outcome.committed
        self.trajectories.append(outcome.trajectory)


def print_progress(report: Report, totals: Callable[[], dict], end: str | None = None) -> None:
    """One line, redrawn in place on a terminal; a line every few seconds in a log. ``totals``: the
    rollout's steps and output tokens so far (``Store.rollout_totals``; on Ray, summed over the nodes)."""
    if end is None:
        if not sys.stderr.isatty():
            now = time.monotonic()
            if now - report.shown_at < 5:
                return
            report.shown_at = now
        end = "\r" if sys.stderr.isatty() else "\n"
    steps = totals()
    print(f"runs {report.done + report.skipped}/{report.total} done ({report.skipped} earlier), {report.running} "
          f"running, {report.failed} failed, {report.timed_out} timed out; {steps['steps']} steps, "
          f"{steps['output_tokens']} output tokens   ", end=end, file=sys.stderr, flush=True)
