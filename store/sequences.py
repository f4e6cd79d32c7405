"""Prefix-sharing storage for sequences that grow turn by turn.

A child step's conversation (and token ids) starts with its parent's conversation plus the
parent's completion. Each step stores only how much of that continuation it keeps
(``base_len``) and what follows (``suffix``), so a trajectory stores its history once, not
once per step.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where ids are packed: the proxy's writer loads it only once a call carries ids.
ID_DTYPE = "<i4"
LOGPROB_DTYPE = "<f4"


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (element equality)."""
    n = min(len(a), len(b))
    np = sys.modules.get("numpy")  # without it loaded, neither is an array
    if np is not None and isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        diff = np.nonzero(a[:n] != b[:n])[0]
        return int(diff[0]) if len(diff) else n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def split_against(seq: Sequence, base: Sequence | None) -> tuple[int, Sequence]:
    """(base_len, suffix) such that ``base[:base_len] + suffix == seq``."""
    if base is None or len(base) == 0:
        return 0, seq
    k = common_prefix_len(base, seq)
    return k, seq[k:]


def pack_ids(ids: Sequence[int] | np.ndarray | None) -> bytes | None:
    import numpy as np

    if ids is None:
        return None
    return np.asarray(ids, dtype=ID_DTYPE).tobytes()


def unpack_ids(blob: bytes | None) -> np.ndarray:
    import numpy as np

    if not blob:
        return np.zeros(0, dtype=ID_DTYPE)
    return np.frombuffer(blob, dtype=ID_DTYPE)


def pack_logprobs(values: Sequence[float] | None) -> bytes | None:
    import numpy as np

    if values is None:
        return None
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def unpack_logprobs(blob: bytes | None) -> np.ndarray | None:
    import numpy as np

    if blob is None:
        return None
    return np.frombuffer(blob, dtype=LOGPROB_DTYPE)
