"""DETR-family and RT-DETR detectors as detectron2 meta-architectures.

The models are the *same implementations* as on the mmdet side, with the same
``state_dict`` keys, so one checkpoint evaluates in both frameworks:

* :class:`LatteHFDetector` holds a transformers detector (RT-DETR, RT-DETRv2, D-FINE, DEIMv2,
  LW-DETR, RF-DETR, YOLOS, Conditional / Deformable DETR) as ``hf`` (the keys of
  :class:`latte_plugin.mmdet.HFDetector`); :class:`LatteRTDETR` is its RT-DETR. It needs torch,
  detectron2 and transformers only: neither mmdet nor mmcv.
* :class:`~latte_plugin.detectron2.mmdet_bridge.MMDetDetector` (and ``LatteDETR``) builds an mmdet
  detector from an mmdet config (the DETR family); it lives in the one module of this adapter
  that imports mmdet (:mod:`latte_plugin.detectron2.mmdet_bridge`).

Only the interfaces are adapted: detectron2's list of dicts in, ``Instances`` out.

LATTE is switched on by the ``latte`` argument (a dict of
:class:`~latte_plugin.calibration.LatteConfig` fields), i.e. by LazyConfig overrides such as
``model.latte.ratio=0.5``. A model with LATTE layers that are not calibrated yet calibrates
itself on its first evaluation forward, from ``calibration_loader`` (a LazyCall'd train-split
loader), so detectron2's own ``lazyconfig_train_net.py --eval-only`` works with a plain
checkpoint; a calibrated checkpoint is used as is.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from detectron2.modeling import META_ARCH_REGISTRY
from detectron2.structures import Boxes, Instances

from ..adapter import ensure_calibrated, swap_attention
from ..nn.install import find_latte_layers
from ..calibration.config import LatteConfig
from ..storage import CheckpointError, check_latte_candidates, key_mismatch, mismatch_message
from ..hf.detectors import (build_detector, default_top_k, detection_targets, detector_outputs, family_of,
                            pixel_mask_of, postprocess)

__all__ = ["LatteMetaArch", "LatteHFDetector", "LatteRTDETR"]

logger = logging.getLogger("detectron2")


def _plain(value: Any) -> Any:
    """LazyConfig passes OmegaConf containers; mmengine and LatteConfig want plain dicts and lists."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - detectron2 depends on omegaconf
        return value
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


class LatteMetaArch(nn.Module):
    """What every LATTE meta-architecture shares: the ``latte`` settings, self-calibration at
    the first evaluation forward, and a strict checkpoint load.

    Args:
        latte: LATTE settings (``LatteConfig`` fields; ``calibrate``: ``auto`` calibrates
            uncalibrated LATTE layers at the first evaluation forward, ``always`` calibrates
            there even if a checkpoint gave them state, ``never`` requires a calibrated
            checkpoint). ``None``: no LATTE.
        calibration_loader: a LazyCall'd detectron2 loader over the train split (or a built
            one); used when the model calibrates itself.
        allow_partial_load: accept a checkpoint whose keys do not match the model's beyond
            LATTE's buffers (by default ``load_state_dict`` refuses it with one error line).

    Subclasses build their modules first, then call :meth:`_setup_latte`, and implement
    ``tensor_forward(batched_inputs)`` (raw head outputs, what calibration compares).
    """

    def _setup_latte(self, latte: Optional[dict], calibration_loader: Any, allow_partial_load: bool) -> None:
        latte = _plain(latte)
        self.latte_cfg = LatteConfig.from_dict(dict(latte)) if latte else None
        self._calibration_loader = calibration_loader
        self._calibrated_here = False
        if self.latte_cfg is not None:
            swap_attention(self, self.latte_cfg.candidates, self.latte_cfg.variant, self.latte_cfg.backend)
        self.allow_partial_load = bool(allow_partial_load)
        self.register_load_state_dict_post_hook(_refuse_mismatched_keys)

    @property
    def device(self) -> torch.device:
        return next(iter(self.parameters())).device

    @staticmethod
    def to_instances(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, height: int,
                     width: int) -> Instances:
        inst = Instances((height, width))
        inst.pred_boxes = Boxes(boxes.detach())
        inst.scores = scores.detach()
        inst.pred_classes = labels.detach().long()
        return inst

    def calibration_loader(self) -> Any:
        """The calibration loader, built from its LazyCall config on first use (``None`` if not given)."""
        loader = self._calibration_loader
        if loader is not None and not hasattr(loader, "__iter__"):
            from detectron2.config import instantiate

            loader = self._calibration_loader = instantiate(loader)
        return loader

    def _maybe_calibrate(self) -> None:
        """At the first evaluation forward: calibrate from ``calibration_loader``, or keep a loaded
        calibration with the inference-time settings applied (``ensure_calibrated``)."""
        if self.latte_cfg is None or self._calibrated_here or not find_latte_layers(self):
            return
        from .calibrate import ADAPTER

        was_training = self.training
        ensure_calibrated(ADAPTER, self, self.latte_cfg, self._required_loader)
        self._calibrated_here = True
        self.train(was_training)

    def _required_loader(self) -> Any:
        if self.latte_cfg.input_size is not None:
            # detectron2's instantiate builds the loader before the model sees it: its resize is fixed
            raise ValueError("model.latte.input_size cannot resize a calibration_loader that is already built: set "
                             "the resize in model.calibration_loader.mapper.augmentations (and dataloader.test), "
                             "or calibrate with tools/calibrate.py LAZYCFG --input-size H [W]")
        loader = self.calibration_loader()
        if loader is None:
            raise ValueError("LATTE layers are not calibrated and the model has no calibration_loader: give "
                             "model.calibration_loader, load a calibrated checkpoint, or set model.latte.calibrate='never'")
        logger.info("[latte] calibrating the LATTE layers on the train split now")
        return loader


@META_ARCH_REGISTRY.register()
class LatteHFDetector(LatteMetaArch):
    """A transformers ``...ForObjectDetection`` (RT-DETR, RT-DETRv2, D-FINE, DEIMv2, LW-DETR,
    RF-DETR, YOLOS, Conditional / Deformable DETR) as ``self.hf``, without mmdet or mmcv.

    The same modules, keys and outputs as :class:`latte_plugin.mmdet.HFDetector` with its
    configs' data preprocessor (BGR -> RGB, ``/255``, the family's normalisation, zero-padded to
    ``pad_size_divisor``), so one checkpoint serves both frameworks.

    Args:
        family: transformers ``model_type``; read from ``pretrained`` when not given.
        hf_config: config keywords (dict, JSON path, or a name under ``latte_plugin/resources/architectures``);
            random initialisation.
        pretrained: a local HF checkpoint directory (``config.json`` + ``model.safetensors``);
            overrides ``hf_config``. hf_overrides: config keys applied on top of it.
        max_per_img: detections kept per image (default: the family's image processor's).
        pad_size_divisor: the batch is zero-padded to a multiple of this.
        latte, calibration_loader, allow_partial_load: see :class:`LatteMetaArch`
            (``latte.candidates='auto'``: the layers :meth:`latte_candidates` finds).
    """

    def __init__(self, family: Optional[str] = None, hf_config: Any = None, pretrained: Optional[str] = None,
                 hf_overrides: Optional[dict] = None, max_per_img: Optional[int] = None, pad_size_divisor: int = 32,
                 latte: Optional[dict] = None, calibration_loader: Any = None,
                 allow_partial_load: bool = False) -> None:
        super().__init__()
        self.hf = build_detector(family, _plain(hf_config), pretrained, _plain(hf_overrides))
        self.family = family_of(self.hf)
        self.max_per_img = int(max_per_img or default_top_k(self.hf))
        self.pad_size_divisor = int(pad_size_divisor)
        self.latte_sites: list = []
        self._setup_latte(latte, calibration_loader, allow_partial_load)

    def latte_candidates(self) -> list[str]:
        """The global softmax attention layers, found by one probe forward (``candidates='auto'``)."""
        from ..hf.discovery import candidate_names, detector_sites

        self.latte_sites = detector_sites(self.hf, prefix="hf.")
        return candidate_names(self.latte_sites)

    def preprocess(self, batched_inputs: list[dict]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """``(pixel_values (B, 3, H, W) RGB normalised as the family's processor, zero-padded;
        per image (h, w) before padding)``."""
        images = [d["image"].to(self.device) for d in batched_inputs]
        sizes = [(int(im.shape[-2]), int(im.shape[-1])) for im in images]
        div = self.pad_size_divisor
        h = -(-max(s[0] for s in sizes) // div) * div
        w = -(-max(s[1] for s in sizes) // div) * div
        batch = images[0].new_zeros((len(images), 3, h, w), dtype=torch.float32)
        mean, std = self.family.mean, self.family.std
        for i, im in enumerate(images):
            rgb = im.flip(0).float()  # BGR -> RGB
            if mean is not None:  # as mmdet's DetDataPreprocessor: (x - 255 m) / (255 s)
                rgb = (rgb - rgb.new_tensor(mean)[:, None, None] * 255) / (rgb.new_tensor(std)[:, None, None] * 255)
            else:
                rgb = rgb / 255.0
            batch[i, :, : im.shape[-2], : im.shape[-1]] = rgb
        return batch, sizes

    def _outputs(self, batched_inputs: list[dict], labels: Optional[list] = None):
        pixels, sizes = self.preprocess(batched_inputs)
        return detector_outputs(self.hf, pixels, pixel_mask_of(pixels, sizes), labels), pixels, sizes

    def tensor_forward(self, batched_inputs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (B, Q, C), pred_boxes (B, Q, 4))``: what calibration compares."""
        out = self._outputs(batched_inputs)[0]
        return out.logits, out.pred_boxes

    def forward(self, batched_inputs: list[dict]):
        if self.training:
            return self._losses(batched_inputs)
        self._maybe_calibrate()
        return self.predict(batched_inputs)

    def predict(self, batched_inputs: list[dict]) -> list[dict]:
        """Inference as it is (no calibration first): ``[{"instances": Instances}]`` in original-image pixels."""
        out, _, sizes = self._outputs(batched_inputs)
        results = []
        for (scores, labels, boxes), d, (h, w) in zip(
                postprocess(self.family.scores, out.logits, out.pred_boxes, sizes, self.max_per_img),
                batched_inputs, sizes):
            oh, ow = int(d.get("height", h)), int(d.get("width", w))
            boxes = boxes / boxes.new_tensor([w / ow, h / oh, w / ow, h / oh])  # to the original image
            results.append({"instances": self.to_instances(boxes, scores, labels, oh, ow)})
        return results

    def _losses(self, batched_inputs: list[dict]) -> dict:
        pixels, sizes = self.preprocess(batched_inputs)
        gts = [d["instances"] for d in batched_inputs]
        targets = [detection_targets([g.gt_boxes.tensor.to(self.device)], [g.gt_classes.to(self.device)], s,
                                     pixels.dtype)[0] for g, s in zip(gts, sizes)]
        out = detector_outputs(self.hf, pixels, pixel_mask_of(pixels, sizes), targets)
        return {"loss": out.loss}


@META_ARCH_REGISTRY.register()
class LatteRTDETR(LatteHFDetector):
    """RT-DETR (``RTDetrForObjectDetection``): :class:`LatteHFDetector` with ``family='rt_detr'``."""

    def __init__(self, hf_config: Any = None, pretrained: Optional[str] = None, **kwargs) -> None:
        super().__init__("rt_detr", hf_config, pretrained, **kwargs)


def _refuse_mismatched_keys(module: LatteMetaArch, incompatible) -> None:
    """``load_state_dict`` post-hook: a checkpoint of another model is an error, not a warning;
    so is one calibrated for other LATTE candidates (as mmdet's hook refuses it)."""
    model_keys = list(module.state_dict())
    loaded = list(incompatible.unexpected_keys) + [k for k in model_keys if k not in set(incompatible.missing_keys)]
    if module.latte_cfg is not None:
        check_latte_candidates(model_keys, loaded, "the checkpoint")
    if module.allow_partial_load:
        return
    missing, unexpected = key_mismatch(model_keys, loaded)
    if missing or unexpected:
        raise CheckpointError(mismatch_message("the checkpoint", missing, unexpected,
                                               "model.allow_partial_load=True"))
