"""The bounded cache of what the store read: rebuilt conversations, token id sequences and blobs."""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any


def _approx_bytes(value: Any) -> int:
    """A cheap size estimate: conversations count their text, id arrays their buffer. A walk with a
    stack of its own, never recursion: a conversation nested 10^5 deep is as cheap to weigh as a flat one."""
    np = sys.modules.get("numpy")  # loaded only once some step carried token ids
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if np is not None and isinstance(item, np.ndarray):
            total += item.nbytes + 100
        elif isinstance(item, str):
            total += len(item) + 50
        elif isinstance(item, dict):
            total += 100
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 60
            stack.extend(item)
        else:
            total += 30
    return total


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
