"""The LLM protocols stepmill understands, found by request path.

Each protocol is one module here ending in its ``PROTOCOL`` (``contract.Protocol``); ``registry`` lists them
in route order, with those other packages register through the ``stepmill.protocols`` entry points.
"""

from __future__ import annotations

from stepmill.protocols.base import Completion, ParsedRequest, ProtocolError
from stepmill.protocols.contract import Protocol
from stepmill.protocols.registry import by_api, match, protocols

__all__ = ["match", "by_api", "protocols", "Protocol", "Completion", "ParsedRequest", "ProtocolError"]
