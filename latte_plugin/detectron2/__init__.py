"""Detectron2 adapter (needs detectron2 installed from its official source; see docs/detectron2.md).

* :class:`LatteHFDetector` and its :class:`LatteRTDETR` (HF transformers only, no mmdet or mmcv), :class:`MMDetDetector` and
  :class:`LatteDETR` (mmdet's DETR family): meta-architectures in ``META_ARCH_REGISTRY``,
  usable with ``L(...)`` in LazyConfig; same implementations and checkpoints as the mmdet side.
* :class:`LinearizeHook` (``HookBase``) and :func:`calibrate_detector` behind it.
* :func:`register_synthetic` registers the embedded generated dataset.
"""
from .calibrate import Detectron2Adapter, calibrate_detector
from .data import register_synthetic
from .hook import LinearizeHook
from .meta_arch import LatteHFDetector, LatteMetaArch, LatteRTDETR
from .mmdet_bridge import LatteDETR, MMDetDetector  # imports mmdet only when such a model is built

__all__ = ["LatteMetaArch", "MMDetDetector", "LatteDETR", "LatteHFDetector", "LatteRTDETR", "LinearizeHook", "calibrate_detector",
           "Detectron2Adapter",
           "register_synthetic"]
