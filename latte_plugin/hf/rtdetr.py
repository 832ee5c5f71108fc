"""RT-DETR names kept for existing configs and code: the RT-DETR family of
:mod:`latte_plugin.hf.detectors`."""
from __future__ import annotations

from functools import partial

from .detectors import build_detector, detection_targets, naive_postprocess, postprocess

__all__ = ["RTDETR_CANDIDATES", "build_rtdetr", "rtdetr_postprocess", "rtdetr_targets", "naive_rtdetr_postprocess"]

#: The 7 attention layers of the paper's RT-DETR protocol (1 AIFI + 6 decoder self-attention),
#: named as in both frameworks' checkpoints (the HF model sits under ``hf.``).
RTDETR_CANDIDATES = ("hf.model.encoder.aifi.*.layers.*.self_attn", "hf.model.decoder.layers.*.self_attn")

build_rtdetr = partial(build_detector, "rt_detr")
rtdetr_postprocess = partial(postprocess, "sigmoid")
naive_rtdetr_postprocess = partial(naive_postprocess, "sigmoid")
rtdetr_targets = detection_targets
