"""On the event loop: each ``response.create`` turn on a Responses WebSocket, handed over as a record.

``HttpCapture`` recognised the upgrade; from there every client ``response.create`` frame opens
a turn and the server's terminal event (or the next ``response.create``, or the socket's close)
ends it. Frames are only matched by their type here, never parsed.
"""

from __future__ import annotations

import time

from mitmproxy import ctx, http

from stepmill.addon.loop_state import Capture, LoopState, Turn, hook_failed
from stepmill.protocols.openai_responses import is_create_frame, is_terminal_frame


class WebSocketTurns:
    def __init__(self, state: LoopState):
        self.state = state
        self.turns: dict[str, Turn] = {}  # the open turn per flow

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
                    self._finish_turn(capture, pending, cut="a new response.create arrived before this turn ended")
                self.turns[flow.id] = Turn(request=content, started=message.timestamp)
                self.state.began(capture.call.tags.trajectory_id)
                return
            turn = self.turns.get(flow.id)
            if turn is None:
                return
            turn.frames.append((message.timestamp, content))
            if is_terminal_frame(content):
                self.turns.pop(flow.id, None)
                self._finish_turn(capture, turn)
        except Exception:
            hook_failed("websocket_message")

    def websocket_end(self, flow: http.HTTPFlow):
        capture: Capture | None = flow.metadata.get("stepmill")
        turn = self.turns.pop(flow.id, None)
        if capture is None or turn is None:
            return
        try:
            reason = flow.websocket.close_reason if flow.websocket else None
            self._finish_turn(capture, turn, cut=f"WebSocket closed before the turn ended"
                                                 f" (code {flow.websocket.close_code if flow.websocket else '?'}"
                                                 f"{', ' + reason if reason else ''})")
        except Exception:
            hook_failed("websocket_end")

    def _finish_turn(self, capture: Capture, turn: Turn, cut: str | None = None):
        record = capture.record("websocket", policy_version=self.state.policy_version,
                                keep_raw=ctx.options.stepmill_keep_raw, started=turn.started, ended=time.time(),
                                cut=cut, frames=[(at, i + 1) for i, (at, _) in enumerate(turn.frames)])
        self.state.hand_off(record, [turn.request] + [content for _, content in turn.frames])
