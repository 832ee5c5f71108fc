"""latte-plugin: training-free LATTE linear attention for pretrained transformers.

* :func:`linearize` - the framework-free flow on any PyTorch / HF ``transformers`` model.
* :mod:`latte_plugin.core` - the math and the flow (torch only).
* :mod:`latte_plugin.mmdet` - MMDetection adapter (``LATTEAttention``, ``LinearizeHook``, ``HFRTDETR``).
"""
from .linearize import linearize, swap_attention

__all__ = ["linearize", "swap_attention"]
