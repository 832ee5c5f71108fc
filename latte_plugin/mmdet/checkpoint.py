"""Checkpoint loading with torch's ``weights_only=True`` (torch >= 2.6 default).

mmengine 0.10.7's Runner pickles its ``message_hub`` into every checkpoint: a
``HistoryBuffer`` (whose statistics methods are pickled as ``getattr(HistoryBuffer, 'min')``)
and numpy scalars/arrays. ``weights_only`` loading rejects all of these. We allow-list
exactly those types (torch's documented mechanism) and map the pickled ``getattr`` to a
restricted one that only returns ``HistoryBuffer``'s registered statistics methods, so a
checkpoint cannot use it to reach anything else. Nothing ever falls back to unsafe
loading. Checkpoints written by this plugin hold tensors and plain types only.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch

__all__ = ["register_safe_globals", "slim_checkpoint"]


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
    from collections import Counter

    safe.append(Counter)
    import codecs

    safe.append(codecs.encode)  # numpy scalars pickle their bytes through _codecs.encode
    safe.append((_history_buffer_getattr, "builtins.getattr"))
    torch.serialization.add_safe_globals(safe)


def _history_buffer_getattr(obj, name: str):
    """``getattr`` as a checkpoint may use it: only ``HistoryBuffer``'s statistics methods."""
    from mmengine.logging.history_buffer import HistoryBuffer

    if obj is HistoryBuffer and name in ("min", "max", "mean", "current") + tuple(HistoryBuffer._statistics_methods):
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f"checkpoint asks for getattr({obj!r}, {name!r}); only HistoryBuffer statistics methods are allowed"
    )


def slim_checkpoint(src: str, dst: str, dtype: "torch.dtype | None" = None) -> dict:
    """Rewrites a Runner checkpoint as ``{'meta': plain, 'state_dict': tensors, 'model': the same
    tensors}`` (no optimizer; ``model`` is detectron2's key, stored once).

    The source loads with ``weights_only=True`` (thanks to :func:`register_safe_globals`);
    the result needs no allow-list at all. ``dtype`` (e.g. ``torch.float16``) stores the
    floating-point weights in that type to keep the file small; they load back into a
    float32 model unchanged.

    Returns:
        The ``meta`` written.
    """
    from ..storage import save_checkpoint

    register_safe_globals()
    ckpt = torch.load(src, map_location="cpu", weights_only=True)
    state = ckpt.get("state_dict", ckpt)
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    src_meta = ckpt.get("meta", {}) or {}
    meta = {"source": src, "epoch": int(src_meta.get("epoch", -1)), "iter": int(src_meta.get("iter", -1)),
            "dtype": str(dtype or "as saved")}
    save_checkpoint(out, meta, dst)
    return meta
