"""MMDetection adapter. Import it from a config:

    custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

It registers ``LATTEAttention`` and the ``HFDetector`` (transformers detectors; ``HFRTDETR`` for RT-DETR) (``MODELS``) and ``LinearizeHook`` (``HOOKS``), and lets
``torch.load(weights_only=True)`` accept the few mmengine classes that Runner-saved
checkpoints contain (see :mod:`.checkpoint`), so no unsafe loading is ever needed.
"""
from .attention import LATTEAttention
from .calibrate import MMDetAdapter, calibrate_detector, install_latte_cores
from .checkpoint import register_safe_globals
from .hook import LinearizeHook
from .hf_detector import HFDetector, HFRTDETR

register_safe_globals()

__all__ = ["HFDetector", "HFRTDETR", "MMDetAdapter", "LATTEAttention", "LinearizeHook", "calibrate_detector", "install_latte_cores", "register_safe_globals"]
