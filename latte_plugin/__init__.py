"""latte-plugin: training-free LATTE linear attention for pretrained transformers.

* :func:`linearize` - the framework-free flow on any PyTorch / HF ``transformers`` model.
* :mod:`latte_plugin.ops`, :mod:`latte_plugin.nn`, :mod:`latte_plugin.calibration` - the kernels, the layers and the
  training-free calibration (torch only).
* :func:`export_onnx` - ONNX export of a calibrated hybrid (standard operators only).
* :mod:`latte_plugin.adapter` - the one adapter protocol every framework implements.
* :mod:`latte_plugin.mmdet` - MMDetection adapter (``LATTEAttention``, ``LinearizeHook``, ``HFRTDETR``).
* :mod:`latte_plugin.detectron2` - detectron2 adapter (``LatteRTDETR``, ``LatteDETR``, ``LinearizeHook``).
"""
from .adapter import Adapter, calibrate, swap_attention
from .export import export_onnx
from .linearize import linearize

__all__ = ["linearize", "swap_attention", "Adapter", "calibrate", "export_onnx"]
