"""``StepmillAddon``: the stepmill addons, composed as mitmproxy composes its own.

mitmproxy's addon manager walks ``addons`` (depth first, in this order) for every event, so each
part below is an addon of its own with only the hooks it needs:

- ``StepmillOptions``: declares the stepmill_* options and refuses bad values, before anything starts;
- ``PipelineLifecycle``: starts the pipeline in ``running`` (its threads then run off the loop), stops it in ``done``;
- ``Doors``: what a call may reach by where it comes from (a sandboxed run's door; admin routes);
- ``ControlEndpoint``: the control API on its magic host, answered in a thread of its own;
- ``HttpCapture``: LLM calls over HTTP (tags, engine ids, stream taps) to records for the pipeline;
- ``WebSocketTurns``: each Responses WebSocket turn to a record.

The control endpoint comes before the HTTP capture: a control call is answered before capture
looks at it. What they share on the event loop (calls in flight, the pipeline) is ``LoopState``.
"""

from __future__ import annotations

from stepmill.addon.control import ControlEndpoint
from stepmill.addon.doors import Doors
from stepmill.addon.http_capture import HttpCapture
from stepmill.addon.loop_state import LoopState
from stepmill.addon.options import StepmillOptions
from stepmill.addon.pipeline_lifecycle import PipelineLifecycle
from stepmill.addon.websocket_turns import WebSocketTurns


class StepmillAddon:
    def __init__(self):
        self.state = LoopState()
        self.control = ControlEndpoint(self.state)
        self.addons = [StepmillOptions(), PipelineLifecycle(self.state, self.control), Doors(self.state),
                       self.control, HttpCapture(self.state), WebSocketTurns(self.state)]
