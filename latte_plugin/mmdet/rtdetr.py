"""Kept for imports written before :mod:`latte_plugin.mmdet.hf_detector`."""
from .hf_detector import RTDETR_CANDIDATES, HFDetector, HFRTDETR  # noqa: F401
from ..hf.rtdetr import rtdetr_postprocess  # noqa: F401
