"""The bounded cache of what the store read: rebuilt conversations, token id sequences and blobs."""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any


def _approx_bytes(value: Any) -> int:
    """A cheap size estimate: conversations count their text, id arrays their buffer."""
    np = sys.modules.get("numpy")  # loaded only once some step carried token ids
    if np is not None and isinstance(value, np.ndarray):
        return value.nbytes + 100
    if isinstance(value, str):
        return len(value) + 50
    if isinstance(value, dict):
        return 100 + sum(_approx_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return 60 + sum(_approx_bytes(v) for v in value)
    return 30


class LRU(OrderedDict):
    """Least recently used first out, bounded by entries and by (estimated) bytes: one 1 MB
    conversation weighs what a thousand small ones do."""

    def __init__(self, size: int, max_bytes: int = 64 * 1024 * 1024):
        super().__init__()
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._sizes: dict = {}

    def put(self, key, value):
        if key in self:
            self.bytes -= self._sizes.get(key, 0)
        self[key] = value
        self._sizes[key] = weight = _approx_bytes(value)
        self.bytes += weight
        self.move_to_end(key)
        while self and (len(self) > self.size or self.bytes > self.max_bytes):
            old, _ = self.popitem(last=False)
            self.bytes -= self._sizes.pop(old, 0)

    def __delitem__(self, key):
        super().__delitem__(key)
        self.bytes -= self._sizes.pop(key, 0)

    def pop(self, key, *default):
        if key in self:
            self.bytes -= self._sizes.pop(key, 0)
        return super().pop(key, *default)
