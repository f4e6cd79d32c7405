"""Answers from an ``http.server`` handler: a status, its length and a body (JSON, most often).

Shared by the small HTTP servers stepmill runs besides the proxy (a node's `stepmill serve` in the
fleet, the simulated LLM), which answer in plain ``http.server``; the control API is answered by the
proxy itself, through mitmproxy's flows. Its users live in rooms that may not import each other (the
fleet, the simulated LLM), so it stands in the foundation, the one room every room may import.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


def send_body(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"",
              content_type: str = "application/json") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def send_json(handler: BaseHTTPRequestHandler, status: int, payload) -> None:
    send_body(handler, status, json.dumps(payload).encode())
