"""On the event loop: each ``response.create`` turn on a Responses WebSocket, handed over as a record.

``HttpCapture`` recognised the upgrade; from there every client ``response.create`` frame opens
a turn and the server's terminal event (or the next ``response.create``, or the socket's close)
ends it. Frames are only matched by their type here, never parsed.
"""

from __future__ import annotations

import dataclasses
import time

from mitmproxy import http

from stepmill.addon.loop_state import Capture, LoopState, hook_failed
from stepmill.pipeline.call_record import CallRecord
from stepmill.protocols.openai_responses import is_create_frame, is_terminal_frame


class WebSocketTurns:
    def __init__(self, state: LoopState):
        self.state = state
        # The open turn per flow: its record and blobs (the response.create frame, then the server's frames)
        self.turns: dict[str, tuple[CallRecord, list[bytes]]] = {}

    def websocket_message(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        if capture is None or flow.websocket is None:
            return
        try:
            message = flow.websocket.messages[-1]
            content = message.content
            if message.from_client:
                if not is_create_frame(content):
                    return  # other client frames (steering, pings, anything unparsable) do not end a turn
                pending = self.turns.pop(flow.id, None)
                if pending is not None:
                    self._finish_turn(pending, cut="a new response.create arrived before this turn ended")
                self.turns[flow.id] = (dataclasses.replace(
                    capture.record, kind="websocket", started=message.timestamp, http_status=101,
                    notes=list(capture.record.notes), frames=[]), [content])
                self.state.began(capture.call.tags.trajectory_id)
                return
            turn = self.turns.get(flow.id)
            if turn is None:
                return
            record, blobs = turn
            record.frames.append((message.timestamp, len(blobs)))
            blobs.append(content)
            if is_terminal_frame(content):
                self.turns.pop(flow.id, None)
                self._finish_turn(turn)
        except Exception:
            hook_failed("websocket_message")

    def websocket_end(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        turn = self.turns.pop(flow.id, None)
        if capture is None or turn is None:
            return
        try:
            reason = flow.websocket.close_reason if flow.websocket else None
            self._finish_turn(turn, cut=f"WebSocket closed before the turn ended"
                                                 f" (code {flow.websocket.close_code if flow.websocket else '?'}"
                                                 f"{', ' + reason if reason else ''})")
        except Exception:
            hook_failed("websocket_end")

    def _finish_turn(self, turn: tuple[CallRecord, list[bytes]], cut: str | None = None):
        record, blobs = turn
        record.ended, record.cut = time.time(), cut
        self.state.hand_off(record, blobs)
