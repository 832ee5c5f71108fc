"""Detectron2 adapter (needs detectron2 installed from its official source; see README).

* :class:`MMDetDetector`, :class:`LatteDETR`, :class:`LatteRTDETR`: meta-architectures in
  ``META_ARCH_REGISTRY``, usable with ``L(...)`` in LazyConfig; same implementations and
  checkpoints as the mmdet side.
* :class:`LinearizeHook` (``HookBase``) and :func:`calibrate_d2_model` behind it.
* :func:`register_synthetic` registers the embedded generated dataset.
"""
from .calibrate import calibrate_d2_model, take_images
from .data import register_synthetic
from .hook import LinearizeHook
from .meta_arch import LatteDETR, LatteRTDETR, MMDetDetector

__all__ = ["MMDetDetector", "LatteDETR", "LatteRTDETR", "LinearizeHook", "calibrate_d2_model", "take_images",
           "register_synthetic"]
