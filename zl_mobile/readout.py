"""Which positions of a micro-batch need a readout (the valid set Omega).

Only positions with a target (labels != -100) go through final_norm + lm_head, so the device
gathers them into a fixed-capacity buffer (static shapes for the exported program).
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def readout_positions(labels: np.ndarray, capacity: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Flat indices of the valid positions of ``labels`` ([B, S], already shifted).

    Returns ``(index int64 [capacity], target int64 [capacity], weight float32 [capacity],
    n_dropped)``: ``index`` holds ``b * S + i`` of each position with ``labels != -100`` in
    row-major order, ``target`` its label, ``weight`` 1.0; unused slots are index 0, target 0,
    weight 0. With more valid positions than ``capacity`` the last ``capacity`` are kept and
    ``n_dropped`` says how many earlier ones were left out.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be an integer array, got dtype {labels.dtype}")
    flat = labels.reshape(-1)
    valid = np.flatnonzero(flat != IGNORE_INDEX)
    n_dropped = max(0, valid.size - int(capacity))
    keep = valid[n_dropped:]
    index = np.zeros(capacity, dtype=np.int64)
    target = np.zeros(capacity, dtype=np.int64)
    weight = np.zeros(capacity, dtype=np.float32)
    index[:keep.size] = keep
    target[:keep.size] = flat[keep]
    weight[:keep.size] = 1.0
    return index, target, weight, int(n_dropped)
