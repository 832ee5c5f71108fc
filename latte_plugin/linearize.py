"""The framework-free entry point: ``latte_plugin.linearize(model, calib_batches, ...)``.

Works on any ``torch.nn.Module`` whose candidate attention modules are
``torch.nn.MultiheadAttention`` (or wrappers holding one as ``.attn``) or HF
``transformers`` attention modules (ViT, CLIP, BERT/RoBERTa, RT-DETR, ...). It runs the
whole flow (swap -> record -> fit -> score -> select) through
:func:`latte_plugin.adapter.calibrate` with a :class:`~latte_plugin.adapter.TorchAdapter`,
the same function the mmdet and detectron2 adapters call, and returns the same report as
``tools/calibrate.py``. Here ``num_images`` counts batches.

Example::

    from transformers import ViTConfig, ViTModel
    import latte_plugin

    model = ViTModel(ViTConfig(num_hidden_layers=6)).eval()
    batches = [{"pixel_values": torch.randn(2, 3, 224, 224)} for _ in range(8)]
    model, report = latte_plugin.linearize(model, batches, candidates=["layers.*.attention"], ratio=0.67)
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from .adapter import TorchAdapter, default_forward, ensure_calibrated, swap_attention
from .calibration.config import LatteConfig

__all__ = ["swap_attention", "linearize", "default_forward"]


@torch.no_grad()
def linearize(
    model: nn.Module,
    calib_batches: Iterable[Any],
    forward: Optional[Callable[[Any], Any]] = None,
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
    **settings: Any,
) -> tuple[nn.Module, Optional[dict]]:
    """Calibrates LATTE on ``model`` without training and makes ``ratio`` of the candidates linear.

    Args:
        model: any module; changed in place (and returned) as the hybrid model.
        calib_batches: unlabeled batches; an iterable (possibly endless: at most
            ``num_images`` batches are taken).
        forward: runs one batch on the model; default :func:`default_forward`.
        all_reduce: sums a float64 tensor across ranks in place (distributed runs).
        log: receives progress lines. progress: show a progress bar (``rich``).
        **settings: :class:`~latte_plugin.calibration.LatteConfig` fields by name, with its
            defaults for those not given (one source: ``python tools/calibrate.py --help``
            lists them): ``candidates`` (``fnmatch`` patterns over module names naming
            attention modules), ``ratio`` or ``num_linear``, ``variant``, ``num_images``,
            ``selection``, ``correction``, ``calibrate='auto'|'always'|'never'``, ...

    Returns:
        ``(model, report)``, the report as written by ``tools/calibrate.py`` (``None`` when
        ``calibrate='auto'`` found the model already calibrated).

    Raises:
        ValueError: unknown setting, a pattern matching nothing, an empty calibration set.
    """
    cfg = LatteConfig.from_dict(settings)
    # calibrate='auto' on a calibrated model keeps its state (mode and threshold still apply)
    return model, ensure_calibrated(TorchAdapter(forward, all_reduce, log, progress), model, cfg, calib_batches)
