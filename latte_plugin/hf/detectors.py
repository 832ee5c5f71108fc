"""transformers' object detectors, framework-free: one registry of families, how to build each
offline, and each family's own pre- and post-processing in tensor form.

The mmdet detector (:class:`latte_plugin.mmdet.HFDetector`) and the detectron2
meta-architecture (:class:`latte_plugin.detectron2.LatteHFDetector`) are thin adapters over
this module; only ``torch`` and ``transformers`` are imported here.

What a family fixes (read from its transformers image processor, so that boxes and scores
equal transformers' own pipeline on the same input):

* ``mean``/``std``: the processor's normalisation after ``/255`` (``None``: it only rescales);
* ``scores``: ``"sigmoid"`` (top-k over queries x classes, RT-DETR / Deformable / Conditional
  DETR / LW-DETR / RF-DETR processors) or ``"softmax"`` (per query, the last class is
  "no object", YOLOS' processor);
* ``pixel_mask``: whether the model takes the padding mask.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..resources import architecture_names, read_architecture

__all__ = ["Family", "FAMILIES", "family_of", "build_detector", "detector_outputs", "postprocess",
           "naive_postprocess", "detection_targets", "default_top_k", "loss_logs", "pixel_mask_of", "load_config_kwargs"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Family:
    """One transformers detector family.

    Attributes:
        name: transformers' ``model_type``.
        model_class, config_class: transformers class names.
        processor: the image processor class transformers maps the family to.
        scores: ``"sigmoid"`` or ``"softmax"`` (see the module docstring).
        mean, std: normalisation after ``/255`` in RGB order, or ``None``.
        pixel_mask: the model's forward takes ``pixel_mask``.
        architecture: the name of its smallest public COCO model's shipped JSON (``latte_plugin.resources``).
        size: that model's evaluation input ``(H, W)``.
        top_k: detections the image processor keeps (``None``: every query).
        probe_size: the smallest square input the model runs on (two-stage LW-DETR / RF-DETR
            need as many encoder tokens as queries; windowed ViTs a multiple of patch x window
            grid): what :mod:`~latte_plugin.hf.discovery` probes with and the tests use.
    """

    name: str
    model_class: str
    config_class: str
    processor: str
    scores: str
    mean: Optional[tuple]
    std: Optional[tuple]
    pixel_mask: bool
    architecture: str
    size: tuple
    top_k: Optional[int] = None
    probe_size: int = 128


def _family(name: str, classes: tuple[str, str, str], scores: str, normalize: bool, mask: bool, arch: str,
            size: tuple, probe_size: int = 128) -> Family:
    """A :class:`Family`; ``classes``: its transformers model, config and image processor class names."""
    model, config, processor = classes
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if normalize else (None, None)
    top_k = 100 if processor in ("DeformableDetrImageProcessor", "ConditionalDetrImageProcessor") else None
    return Family(name, model, config, processor, scores, mean, std, mask, arch, size, top_k, probe_size)


#: The families, by transformers ``model_type``.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    _family("rt_detr", ("RTDetrForObjectDetection", "RTDetrConfig", "RTDetrImageProcessor"), "sigmoid", False, True,
            "rt_detr_r18vd", (640, 640)),
    _family("rt_detr_v2", ("RTDetrV2ForObjectDetection", "RTDetrV2Config", "RTDetrImageProcessor"), "sigmoid", False,
            True, "rt_detr_v2_r18vd", (640, 640)),
    _family("d_fine", ("DFineForObjectDetection", "DFineConfig", "RTDetrImageProcessor"), "sigmoid", False, True,
            "d_fine_s", (640, 640)),
    _family("deimv2", ("Deimv2ForObjectDetection", "Deimv2Config", "RTDetrImageProcessor"), "sigmoid", True, True,
            "deimv2_dinov3_s", (640, 640)),
    _family("lw_detr", ("LwDetrForObjectDetection", "LwDetrConfig", "DeformableDetrImageProcessor"), "sigmoid", True,
            True, "lw_detr_tiny", (640, 640), probe_size=256),
    _family("rf_detr", ("RfDetrForObjectDetection", "RfDetrConfig", "RfDetrImageProcessor"), "sigmoid", True, True,
            "rf_detr_nano", (384, 384), probe_size=288),
    _family("yolos", ("YolosForObjectDetection", "YolosConfig", "YolosImageProcessor"), "softmax", True, False,
            "yolos_tiny", (800, 1333)),
    _family("conditional_detr", ("ConditionalDetrForObjectDetection", "ConditionalDetrConfig",
                                 "ConditionalDetrImageProcessor"), "sigmoid", True, True, "conditional_detr_r50", (800, 1333)),
    _family("deformable_detr", ("DeformableDetrForObjectDetection", "DeformableDetrConfig",
                                "DeformableDetrImageProcessor"), "sigmoid", True, True, "deformable_detr_r50", (800, 1333)),
)}


def family_of(name_or_model: Union[str, nn.Module]) -> Family:
    """The :class:`Family` of a ``model_type`` or of a built transformers model."""
    name = name_or_model if isinstance(name_or_model, str) else getattr(name_or_model.config, "model_type", "")
    if name not in FAMILIES:
        raise ValueError(f"detector family {name!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def load_config_kwargs(hf_config: Union[None, dict, str]) -> dict:
    """Config keywords from a dict, a JSON file of them (an HF ``config.json`` works too), or the
    name of an architecture the package ships (``latte_plugin.resources``, e.g. ``"deimv2_dinov3_s"``).
    Keys starting with ``_`` (comments such as ``_source``) are dropped."""
    if hf_config is None:
        return {}
    if isinstance(hf_config, str):
        if os.path.isfile(hf_config):
            with open(hf_config, encoding="utf-8") as f:
                hf_config = json.load(f)
        elif hf_config in architecture_names():
            hf_config = read_architecture(hf_config)
        else:
            raise FileNotFoundError(f"{hf_config}: no such detector config JSON; give config keywords as a dict, "
                                    f"a JSON path, or one of {', '.join(architecture_names())}")
    return {k: v for k, v in dict(hf_config).items() if not k.startswith("_")}


def build_detector(family: Optional[str] = None, hf_config: Union[None, dict, str] = None,
                   pretrained: Optional[str] = None, hf_overrides: Optional[dict] = None) -> nn.Module:
    """A transformers ``...ForObjectDetection``, offline.

    Args:
        family: transformers ``model_type`` (e.g. ``"deimv2"``); read from ``pretrained`` if ``None``.
        hf_config: config keywords (see :func:`load_config_kwargs`); random initialisation.
        pretrained: a local HF checkpoint directory (``config.json`` + ``model.safetensors``);
            overrides ``hf_config``.
        hf_overrides: config keys applied on top of ``pretrained`` or ``hf_config`` (e.g. ``num_labels``).

    Raises:
        ValueError: an unknown family, or ``pretrained`` holding another family than ``family``.
    """
    import transformers

    if pretrained is not None:
        cfg_path = os.path.join(pretrained, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{pretrained}: not an HF checkpoint directory (no config.json); give the "
                                    "directory save_pretrained wrote")
        with open(cfg_path, encoding="utf-8") as f:
            saved = json.load(f).get("model_type")
        if family is not None and saved != family:
            raise ValueError(f"{cfg_path}: model_type {saved!r}, but this config builds {family!r}; point "
                             "pretrained at a checkpoint of this family or change the family")
        fam = family_of(saved)
        cls = getattr(transformers, fam.model_class)
        return cls.from_pretrained(pretrained, local_files_only=True, ignore_mismatched_sizes=bool(hf_overrides),
                                   **(hf_overrides or {}))
    fam = family_of(family or "rt_detr")
    config = getattr(transformers, fam.config_class)(**{**load_config_kwargs(hf_config), **(hf_overrides or {})})
    return getattr(transformers, fam.model_class)(config)


def default_top_k(model: nn.Module) -> int:
    """Detections per image the family's image processor keeps: its ``top_k``, else every query."""
    cfg = model.config
    return int(family_of(model).top_k or getattr(cfg, "num_queries", None) or cfg.num_detection_tokens)


def pixel_mask_of(batch: Tensor, sizes: Sequence[tuple[int, int]]) -> Tensor:
    """``(B, H, W)`` long mask, 1 on each image's ``(h, w)`` and 0 on the padding (HF's ``pixel_mask``)."""
    mask = batch.new_zeros((batch.shape[0], batch.shape[-2], batch.shape[-1]), dtype=torch.long)
    for i, (h, w) in enumerate(sizes):
        mask[i, :h, :w] = 1
    return mask


def detector_outputs(model: nn.Module, pixels: Tensor, pixel_mask: Optional[Tensor] = None,
                     labels: Optional[list] = None):
    """Runs the transformers detector; ``pixel_mask`` is passed only to families that take it."""
    kwargs = {"pixel_values": pixels}
    if labels is not None:
        kwargs["labels"] = labels
    if pixel_mask is not None and family_of(model).pixel_mask:
        kwargs["pixel_mask"] = pixel_mask
    return model(**kwargs)


def _xyxy_pixels(boxes: Tensor, image_hw: Sequence[tuple[int, int]]) -> Tensor:
    cx, cy, w, h = boxes.unbind(-1)
    xyxy = torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)
    scale = torch.tensor([[wd, ht, wd, ht] for ht, wd in image_hw], dtype=xyxy.dtype, device=xyxy.device)
    return xyxy * scale[:, None, :]


def postprocess(scores_kind: str, logits: Tensor, boxes: Tensor, image_hw: Sequence[tuple[int, int]], top_k: int):
    """The family's ``post_process_object_detection`` without its threshold, batched.

    Args:
        scores_kind: ``"sigmoid"`` (top-k over queries x classes) or ``"softmax"`` (per query,
            best real class; the last logit is "no object"; the ``top_k`` best queries kept).
        logits: ``(B, Q, C)`` (``C + 1`` for softmax). boxes: ``(B, Q, 4)`` normalised ``(cx, cy, w, h)``.
        image_hw: per image, the ``(H, W)`` the normalised boxes refer to.
        top_k: detections kept per image.

    Returns:
        A list of ``(scores (K,), labels (K,), boxes (K, 4) xyxy in pixels)``.
    """
    b, q, c = logits.shape
    xyxy = _xyxy_pixels(boxes, image_hw)
    if scores_kind == "softmax":
        scores, labels = logits.softmax(-1)[..., :-1].max(-1)
        scores, query = torch.topk(scores, min(top_k, q), dim=-1)
        labels = labels.gather(1, query)
    else:
        scores, index = torch.topk(torch.sigmoid(logits).flatten(1), min(top_k, q * c), dim=-1)
        labels, query = index % c, index // c
    picked = xyxy.gather(1, query.unsqueeze(-1).expand(-1, -1, 4))
    return [(scores[i], labels[i], picked[i]) for i in range(b)]


def naive_postprocess(scores_kind: str, logits: Tensor, boxes: Tensor, image_hw: Sequence[tuple[int, int]],
                      top_k: int):
    """Reference for :func:`postprocess`: one image and one detection at a time."""
    out = []
    for lg, bx, (ht, wd) in zip(logits, boxes, image_hw):
        cands = []
        for qi in range(lg.shape[0]):
            if scores_kind == "softmax":
                p = lg[qi].softmax(-1)[:-1]
                cands.append((float(p.max()), int(p.argmax()), qi))
            else:
                cands.extend((float(s), ci, qi) for ci, s in enumerate(torch.sigmoid(lg[qi])))
        cands = sorted(cands, key=lambda t: -t[0])[:top_k]
        rows = []
        for _, ci, qi in cands:
            cx, cy, w, h = bx[qi].tolist()
            rows.append([(cx - w / 2) * wd, (cy - h / 2) * ht, (cx + w / 2) * wd, (cy + h / 2) * ht])
        out.append((torch.tensor([t[0] for t in cands]), torch.tensor([t[1] for t in cands]), torch.tensor(rows)))
    return out


def detection_targets(boxes_xyxy: Sequence[Tensor], labels: Sequence[Tensor], input_hw: tuple[int, int],
                      dtype: torch.dtype) -> list[dict]:
    """Ground truth as transformers' detection losses want it: per image ``{class_labels (K,),
    boxes (K, 4)}``, boxes as ``(cx, cy, w, h)`` normalised by the network input size ``input_hw``."""
    h, w = input_hw
    out = []
    for b, lab in zip(boxes_xyxy, labels):
        b = b.to(dtype)
        cxcywh = torch.stack([(b[:, 0] + b[:, 2]) / 2 / w, (b[:, 1] + b[:, 3]) / 2 / h,
                              (b[:, 2] - b[:, 0]) / w, (b[:, 3] - b[:, 1]) / h], dim=-1)
        out.append({"class_labels": lab.long(), "boxes": cxcywh})
    return out


def loss_logs(output) -> dict:
    """``{"loss": total}`` plus each term of transformers' ``loss_dict`` detached (logged, not
    summed: mmengine sums keys containing ``loss``, so the terms lose that prefix)."""
    logs = {"loss": output.loss}
    for key, value in (getattr(output, "loss_dict", None) or {}).items():
        if torch.is_tensor(value) and value.dim() == 0 and not key[-1].isdigit():
            logs[key.replace("loss_", "")] = value.detach()
    return logs
