"""What the stepmill addons share on the event loop: the calls in flight and where they are handed.

Everything here is changed on mitmproxy's event loop only, so it needs no lock: the threads that
learn of a change (the control thread, the state watch) hand it to the loop (``on_loop``), which
makes the changes in the order they came. The one read from another thread is the control thread's
status of this worker (``in_flight_total()``, ``pipeline``): a snapshot, a moment old at most. The
pipeline (the handoff thread, the writer) lives off the loop; ``hand_off`` is the one way a
finished call reaches it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from stepmill import tags as tagging
from stepmill.addon import engine
from stepmill.addon.stream_tap import StreamTap
from stepmill.auth.runs import RunTable
from stepmill.pipeline.call_record import Call, CallRecord
from stepmill.pipeline.service import Pipeline
from stepmill.protocols.contract import ChatTranslation, Protocol

log = logging.getLogger("stepmill")

T = TypeVar("T")


def hook_failed(name: str) -> None:
    """Hooks never raise into mitmproxy; the test suite reads this line to show none failed."""
    log.exception(f"stepmill: {name} hook failed")


@dataclass
class Capture:
    """What the addons know about one LLM call while it is in flight (``flow.metadata["stepmill"]``)."""

    # The call's record, made once when its request is recognised; the hooks add the response's facts and
    # hand it over as it is (a WebSocket's is the pattern each of its turns' records is made from)
    record: CallRecord
    protocol: Protocol  # of the exchange on the wire: the agent's, or the engine's chat once translated
    raw_request: bytes
    websocket: bool = False
    added: engine.Added = field(default_factory=engine.Added)
    tap: StreamTap | None = None
    done: bool = False
    translated: dict | None = None  # a call served through chat: its translator's options
    via: ChatTranslation | None = None  # then, the agent's protocol's translation (Protocol.via_chat)

    @property
    def call(self) -> Call:
        return self.record.call


class LoopState:
    """Shared by the addons of one ``StepmillAddon``."""

    def __init__(self):
        self.pipeline: Pipeline | None = None  # from `running` until `done` (PipelineLifecycle)
        self.runs = RunTable()  # registered runs: told by the control API and by the pipeline's state watch
        self.connection_tags: dict[str, tagging.Tags] = {}  # proxy credentials per client connection
        # Calls in flight (request seen, not yet handed off) per trajectory: what a barrier waits for.
        self.inflight: collections.Counter = collections.Counter()

    @staticmethod
    def on_loop(change: Callable[[T], None]) -> Callable[[T], None]:
        """``change`` as a callback for another thread: made at once when called on the loop (a state
        watch's first read, as it starts), else queued to the loop. Queued before the control thread
        answers, a change is made before the answer goes out: a run is checked from the next call on.
        Call it on the loop."""
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()

        def apply(value: T) -> None:
            if threading.get_ident() == loop_thread:
                change(value)
            else:
                loop.call_soon_threadsafe(change, value)

        return apply

    # Each of these takes a call's trajectory as its tags say: None is a call that names none.
    def began(self, trajectory_id: str | None) -> None:
        self.inflight[trajectory_id] += 1

    def settled(self, trajectory_id: str | None) -> None:
        """A call of ``trajectory_id`` is no longer in flight (handed off, upgraded or not ours)."""
        self.inflight[trajectory_id] -= 1
        if self.inflight[trajectory_id] <= 0:
            del self.inflight[trajectory_id]

    def in_flight_of(self, trajectory_id: str | None) -> int:
        """Calls of ``trajectory_id`` in flight."""
        return self.inflight.get(trajectory_id, 0)

    def in_flight_total(self) -> int:
        """Calls in flight, of every trajectory and of none."""
        return sum(self.inflight.values())

    def hand_off(self, record: CallRecord, blobs: list) -> None:
        """O(1): the pipeline queues the record and its blobs (references to bytes, no copies)."""
        if self.pipeline is not None:
            self.pipeline.submit(record, blobs)
        self.settled(record.call.tags.trajectory_id)
