"""Checkpoint loading with torch's ``weights_only=True`` (torch >= 2.6 default).

mmengine 0.10.7's Runner pickles a ``HistoryBuffer`` and numpy scalars/arrays into the
``message_hub`` of every checkpoint it saves, which ``weights_only`` loading rejects. We
allow-list exactly those types (torch's documented mechanism), never falling back to
unsafe loading. Checkpoints written by this plugin hold tensors and plain types only.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["register_safe_globals"]


def register_safe_globals() -> None:
    """Adds mmengine's ``HistoryBuffer`` and numpy's array reconstruction to torch's safe globals."""
    from mmengine.logging.history_buffer import HistoryBuffer

    safe = [HistoryBuffer, np.ndarray, np.dtype]
    try:
        safe.append(np.core.multiarray._reconstruct)  # numpy < 2
    except AttributeError:  # pragma: no cover
        safe.append(np._core.multiarray._reconstruct)
    safe += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    safe.append(np.core.multiarray.scalar if hasattr(np.core.multiarray, "scalar") else np._core.multiarray.scalar)
    torch.serialization.add_safe_globals(safe)
