"""The plugin's mmdet detectors as plain ``pixels -> raw outputs`` modules, for ONNX export,
and the post-processing that turns those raw outputs into mmdet predictions.

The graph input is what mmdet's ``DetDataPreprocessor`` produces (normalised, RGB/BGR as the
config says, padded to ``pad_size_divisor``); the graph outputs are the detection head's raw
outputs of the last decoder layer: ``(scores_logits (B, Q, C'), boxes (B, Q, 4))``, boxes as
normalised ``(cx, cy, w, h)``. Post-processing (top-k, rescaling) stays outside the graph and is
the detector's own (:func:`predict_from_raw`), so onnxruntime results go through the same code
and the same ``CocoMetric`` as the torch model.

DETR-family graphs assume that every input pixel is image (no padding mask): feed one image
at a time, as :func:`predict_from_raw`'s callers do.
"""
from __future__ import annotations

from typing import Sequence

from mmdet.structures import DetDataSample
from torch import Tensor, nn

from .hf_detector import HFDetector

__all__ = ["RawOutputs", "predict_from_raw"]


class RawOutputs(nn.Module):
    """``pixels (B, 3, H, W) -> (logits (B, Q, C'), boxes (B, Q, 4))`` of an mmdet detector."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        det = self.detector
        if isinstance(det, HFDetector):
            return det._forward(pixels)
        hw = (pixels.shape[-2], pixels.shape[-1])
        samples = [DetDataSample(metainfo=dict(img_shape=hw, batch_input_shape=hw)) for _ in range(pixels.shape[0])]
        cls_scores, bbox_preds = det._forward(pixels, samples)[:2]
        return cls_scores[-1], bbox_preds[-1]


def predict_from_raw(detector: nn.Module, logits: Tensor, boxes: Tensor, pixels_hw: tuple[int, int],
                     data_samples: Sequence[DetDataSample], rescale: bool = True):
    """The detector's own post-processing on raw outputs: ``data_samples`` with ``pred_instances``."""
    if isinstance(detector, HFDetector):
        return detector.predict_raw(logits, boxes, pixels_hw, data_samples, rescale)
    metas = [ds.metainfo for ds in data_samples]
    results = detector.bbox_head.predict_by_feat(logits[None], boxes[None], batch_img_metas=metas, rescale=rescale)
    return detector.add_pred_to_datasample(data_samples, results)
