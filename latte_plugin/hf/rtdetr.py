"""RT-DETR pieces shared by the mmdet detector (:class:`latte_plugin.mmdet.HFRTDETR`) and the
detectron2 meta-architecture (:class:`latte_plugin.detectron2.LatteRTDETR`): building HF's
``RTDetrForObjectDetection`` offline, its post-processing and its training targets.

Only ``torch`` and ``transformers`` are imported, so a detectron2 user needs neither mmdet nor mmcv.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

__all__ = ["RTDETR_CANDIDATES", "build_rtdetr", "rtdetr_postprocess", "rtdetr_targets", "naive_rtdetr_postprocess"]

#: The 7 attention layers of the paper's RT-DETR protocol (1 AIFI + 6 decoder self-attention),
#: named as in both frameworks' checkpoints (the HF model sits under ``hf.``).
RTDETR_CANDIDATES = ("hf.model.encoder.aifi.*.layers.*.self_attn", "hf.model.decoder.layers.*.self_attn")


def _config_kwargs(hf_config: Union[None, dict, str]) -> dict:
    """``RTDetrConfig`` keywords from a dict or a JSON file of them (an HF ``config.json`` works too)."""
    if hf_config is None:
        return {}
    if isinstance(hf_config, str):
        if not os.path.isfile(hf_config):
            raise FileNotFoundError(f"{hf_config}: no such RT-DETR config JSON; give RTDetrConfig keywords "
                                    "as a dict or the path of a JSON file holding them")
        with open(hf_config, encoding="utf-8") as f:
            return json.load(f)
    return dict(hf_config)


def build_rtdetr(hf_config: Union[None, dict, str] = None, pretrained: Optional[str] = None,
                 hf_overrides: Optional[dict] = None) -> nn.Module:
    """HF ``RTDetrForObjectDetection``, offline.

    Args:
        hf_config: ``RTDetrConfig`` keywords (dict or JSON path); random initialisation.
        pretrained: a local HF checkpoint directory (``config.json`` + ``model.safetensors``);
            overrides ``hf_config``.
        hf_overrides: config keys applied on top of ``pretrained`` (e.g. ``num_labels``).
    """
    from transformers import RTDetrConfig, RTDetrForObjectDetection

    if pretrained is not None:
        return RTDetrForObjectDetection.from_pretrained(
            pretrained, local_files_only=True, ignore_mismatched_sizes=bool(hf_overrides), **(hf_overrides or {}))
    return RTDetrForObjectDetection(RTDetrConfig(**_config_kwargs(hf_config)))


def naive_rtdetr_postprocess(logits: Tensor, boxes: Tensor, image_hw: Sequence[tuple[int, int]], top_k: int):
    """Reference for :func:`rtdetr_postprocess`: one image at a time, as HF's
    ``post_process_object_detection`` (focal / sigmoid branch) writes it."""
    out = []
    for lg, bx, (ht, wd) in zip(logits, boxes, image_hw):
        q, c = lg.shape
        scores, index = torch.topk(torch.sigmoid(lg).flatten(), min(top_k, q * c))
        cx, cy, w, h = bx[index // c].unbind(-1)
        xyxy = torch.stack([(cx - w / 2) * wd, (cy - h / 2) * ht, (cx + w / 2) * wd, (cy + h / 2) * ht], -1)
        out.append((scores, index % c, xyxy))
    return out


def rtdetr_postprocess(logits: Tensor, boxes: Tensor, image_hw: Sequence[tuple[int, int]], top_k: int):
    """HF's RT-DETR post-processing (focal / sigmoid branch), batched.

    Args:
        logits: ``(B, Q, C)``. boxes: ``(B, Q, 4)`` normalised ``(cx, cy, w, h)``.
        image_hw: per image, the ``(H, W)`` the normalised boxes refer to.
        top_k: detections kept per image (HF keeps ``Q``).

    Returns:
        A list of ``(scores (K,), labels (K,), boxes (K, 4) xyxy in pixels)``.
    """
    b, q, c = logits.shape
    cx, cy, w, h = boxes.unbind(-1)
    xyxy = torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)
    scale = torch.tensor([[wd, ht, wd, ht] for ht, wd in image_hw], dtype=xyxy.dtype, device=xyxy.device)
    xyxy = xyxy * scale[:, None, :]
    scores, index = torch.topk(torch.sigmoid(logits).flatten(1), min(top_k, q * c), dim=-1)
    labels = index % c
    query = index // c
    picked = xyxy.gather(1, query.unsqueeze(-1).expand(-1, -1, 4))
    return [(scores[i], labels[i], picked[i]) for i in range(b)]


def rtdetr_targets(boxes_xyxy: Sequence[Tensor], labels: Sequence[Tensor], input_hw: tuple[int, int],
                   dtype: torch.dtype) -> list[dict]:
    """Ground truth as HF's loss wants it: per image ``{class_labels (K,), boxes (K, 4)}``,
    boxes as ``(cx, cy, w, h)`` normalised by the network input size ``input_hw``."""
    h, w = input_hw
    out = []
    for b, lab in zip(boxes_xyxy, labels):
        b = b.to(dtype)
        cxcywh = torch.stack([(b[:, 0] + b[:, 2]) / 2 / w, (b[:, 1] + b[:, 3]) / 2 / h,
                              (b[:, 2] - b[:, 0]) / w, (b[:, 3] - b[:, 1]) / h], dim=-1)
        out.append({"class_labels": lab.long(), "boxes": cxcywh})
    return out
