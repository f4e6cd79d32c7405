"""A group's batch on the wire between a node and a trainer: the layout options a batch request may ask
for, and batches as safetensors bytes (one batch, or several in one file). Both sides use it: the node's
server (``node_server``) writes the bytes, the consumers (``node_consumer``, ``remote_consumer``) read them.
"""

from __future__ import annotations

import json
import struct
from collections import Counter

import numpy as np

from stepmill.trainer_bridge.layouts import Batch

# The step layout's options a group's batch may be asked with (query parameters), and their types.
LAYOUT_FIELDS = {"max_prompt_length": int, "max_response_length": int, "overlong": str, "pad_id": int}


def batch_bytes(batch: Batch) -> bytes:
    from safetensors.numpy import save

    tensors = {name: np.ascontiguousarray(array) for name, array in batch.tensors.items()}
    return save(tensors, metadata={"meta": json.dumps(batch.meta, default=str),
                                   "report": json.dumps(dict(batch.report))})


def batch_from_bytes(data: bytes) -> Batch:
    from safetensors.numpy import load

    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
    return Batch(load(data), json.loads(metadata.get("meta", "{}")), Counter(json.loads(metadata.get("report", "{}"))))


def batches_bytes(batches: list[Batch]) -> bytes:
    """Several batches in one safetensors file: batch i's arrays named ``i/name``."""
    from safetensors.numpy import save

    tensors = {f"{i}/{name}": np.ascontiguousarray(array) for i, batch in enumerate(batches)
               for name, array in batch.tensors.items()}
    return save(tensors, metadata={"batches": json.dumps([{"meta": b.meta, "report": dict(b.report)}
                                                          for b in batches], default=str)})


def batches_from_bytes(data: bytes) -> list[Batch]:
    from safetensors.numpy import load

    (length,) = struct.unpack("<Q", data[:8])
    described = json.loads((json.loads(data[8:8 + length]).get("__metadata__") or {}).get("batches", "[]"))
    arrays = load(data)
    return [Batch({name.partition("/")[2]: array for name, array in arrays.items() if name.startswith(f"{i}/")},
                  about["meta"], Counter(about["report"])) for i, about in enumerate(described)]
