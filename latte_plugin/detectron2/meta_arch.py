"""DETR-family and RT-DETR detectors as detectron2 meta-architectures.

The models are the *same implementations* as on the mmdet side: :class:`MMDetDetector`
builds an mmdet detector from an mmdet config (mmdet's DETR family, or
:class:`latte_plugin.mmdet.HFRTDETR` for RT-DETR) and adopts its children, so its
``state_dict`` keys are mmdet's and one checkpoint evaluates in both frameworks.
Only the interfaces are adapted: detectron2's list of dicts in, ``Instances`` out.

LATTE is switched on by the ``latte`` argument (a dict of
:class:`~latte_plugin.core.LatteConfig` fields), i.e. by LazyConfig overrides such as
``model.latte.ratio=0.5``. A model with LATTE layers that are not calibrated yet calibrates
itself on its first evaluation forward, from ``calibration_loader`` (a LazyCall'd train-split
loader), so detectron2's own ``lazyconfig_train_net.py --eval-only`` works with a plain
checkpoint; a calibrated checkpoint is used as is.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from detectron2.modeling import META_ARCH_REGISTRY
from detectron2.structures import Boxes, Instances

from ..core.flow import LatteConfig, find_latte_layers, needs_calibration
from ..core.io import CheckpointError, key_mismatch, mismatch_message
from ..linearize import swap_attention

__all__ = ["MMDetDetector", "LatteDETR", "LatteRTDETR"]

logger = logging.getLogger("detectron2")
#: The repository's configs/ (default configs resolve against it, not the working directory).
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def _plain(value: Any) -> Any:
    """LazyConfig passes OmegaConf containers; mmengine and LatteConfig want plain dicts and lists."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - detectron2 depends on omegaconf
        return value
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _build_mmdet_model(mmdet_config: str, overrides: Optional[dict] = None) -> nn.Module:
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    import latte_plugin.mmdet  # noqa: F401  (HFRTDETR, safe checkpoint globals)

    register_all_modules()
    if mmdet_config.startswith("mmdet::"):  # a config shipped with mmdet
        import os

        import mmdet

        mmdet_config = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", mmdet_config.split("::", 1)[1])
    cfg = Config.fromfile(mmdet_config)
    model_cfg = copy.deepcopy(cfg.model)
    if overrides:
        model_cfg.merge_from_dict(overrides) if hasattr(model_cfg, "merge_from_dict") else model_cfg.update(overrides)
    return MODELS.build(model_cfg)


@META_ARCH_REGISTRY.register()
class MMDetDetector(nn.Module):
    """An mmdet detector in detectron2's interface.

    Args:
        mmdet_config: path of the mmdet config whose ``model`` is built (the same config and
            checkpoint as on the mmdet side).
        latte: LATTE settings (``LatteConfig`` fields; ``calibrate``: ``auto`` calibrates
            uncalibrated LATTE layers at the first evaluation forward, ``always`` calibrates
            there even if a checkpoint gave them state, ``never`` requires a calibrated
            checkpoint). ``None``: no LATTE.
        calibration_loader: a LazyCall'd detectron2 loader over the train split (or a built
            one); used when the model calibrates itself.
        model_overrides: keys merged into the mmdet model config.
        allow_partial_load: accept a checkpoint whose keys do not match the model's beyond
            LATTE's buffers (by default ``load_state_dict`` refuses it with one error line).
    """

    def __init__(
        self,
        mmdet_config: str,
        latte: Optional[dict] = None,
        calibration_loader: Any = None,
        model_overrides: Optional[dict] = None,
        allow_partial_load: bool = False,
    ) -> None:
        super().__init__()
        latte, model_overrides = _plain(latte), _plain(model_overrides)
        det = _build_mmdet_model(mmdet_config, model_overrides)
        for name, child in det.named_children():  # mmdet's keys, so checkpoints are shared
            self.add_module(name, child)
        object.__setattr__(self, "_det", det)  # the same modules, not registered twice
        self.latte_cfg = LatteConfig.from_dict(dict(latte)) if latte else None
        self._calibration_loader = calibration_loader
        self._calibrated_here = False
        if self.latte_cfg is not None:
            swap_attention(self, self.latte_cfg.candidates, self.latte_cfg.variant)
        self.allow_partial_load = bool(allow_partial_load)
        self.register_load_state_dict_post_hook(_refuse_mismatched_keys)

    def train(self, mode: bool = True) -> "MMDetDetector":
        super().train(mode)
        self._det.training = mode  # the wrapped detector object itself (its children are ours)
        return self

    # -- conversions ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(iter(self.parameters())).device

    def to_mmdet(self, batched_inputs: list[dict], training: bool) -> dict:
        """detectron2 dicts (``image`` (C, H, W) in BGR, ``height``/``width`` of the original)
        -> mmdet's preprocessed ``{'inputs', 'data_samples'}``."""
        from mmdet.structures import DetDataSample
        from mmengine.structures import InstanceData

        inputs, samples = [], []
        for d in batched_inputs:
            img = d["image"]
            h, w = int(img.shape[-2]), int(img.shape[-1])
            oh, ow = int(d.get("height", h)), int(d.get("width", w))
            ds = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(oh, ow), scale_factor=(w / ow, h / oh),
                                             img_id=d.get("image_id")))
            if training:
                gt = d["instances"]
                ds.gt_instances = InstanceData(bboxes=gt.gt_boxes.tensor.float(), labels=gt.gt_classes.long())
            inputs.append(img)
            samples.append(ds)
        return self._det.data_preprocessor({"inputs": inputs, "data_samples": samples}, training)

    @staticmethod
    def to_instances(pred, height: int, width: int) -> Instances:
        inst = Instances((height, width))
        inst.pred_boxes = Boxes(pred.bboxes.detach())
        inst.scores = pred.scores.detach()
        inst.pred_classes = pred.labels.detach().long()
        return inst

    # -- forward ---------------------------------------------------------------------------
    def tensor_forward(self, batched_inputs: list[dict]):
        """Raw head outputs (mmdet's ``mode='tensor'``): what calibration compares."""
        data = self.to_mmdet(batched_inputs, False)
        return self._det(**data, mode="tensor")

    def forward(self, batched_inputs: list[dict]):
        if self.training:
            data = self.to_mmdet(batched_inputs, True)
            losses = self._det(**data, mode="loss")
            return {k: v for k, v in losses.items() if "loss" in k}
        self._maybe_calibrate()
        data = self.to_mmdet(batched_inputs, False)
        preds = self._det(**data, mode="predict")
        return [{"instances": self.to_instances(p.pred_instances, int(d.get("height", p.ori_shape[0])),
                                                int(d.get("width", p.ori_shape[1])))}
                for p, d in zip(preds, batched_inputs)]

    def _maybe_calibrate(self) -> None:
        if self.latte_cfg is None or self._calibrated_here or not find_latte_layers(self):
            return
        if not needs_calibration(self, self.latte_cfg.calibrate):
            return
        if self._calibration_loader is None:
            raise ValueError("LATTE layers are not calibrated and the model has no calibration_loader: give "
                             "model.calibration_loader, load a calibrated checkpoint, or set model.latte.calibrate='never'")
        from .calibrate import calibrate_d2_model

        loader = self._calibration_loader
        if not hasattr(loader, "__iter__"):
            from detectron2.config import instantiate

            loader = instantiate(loader)
        logger.info("[latte] calibrating the LATTE layers on the train split now")
        was_training = self.training
        calibrate_d2_model(self, loader, self.latte_cfg)
        self._calibrated_here = True
        self.train(was_training)


def _refuse_mismatched_keys(module: "MMDetDetector", incompatible) -> None:
    """``load_state_dict`` post-hook: a checkpoint of another model is an error, not a warning."""
    if module.allow_partial_load:
        return
    missing, unexpected = key_mismatch(list(module.state_dict()),
                                       [k for k in incompatible.unexpected_keys] +
                                       [k for k in module.state_dict() if k not in set(incompatible.missing_keys)])
    if missing or unexpected:
        raise CheckpointError(mismatch_message("the checkpoint", missing, unexpected,
                                               "model.allow_partial_load=True"))


@META_ARCH_REGISTRY.register()
class LatteDETR(MMDetDetector):
    """DETR-family detector (mmdet's DETR / Conditional / DAB-DETR); default: DETR-R50 on COCO."""

    def __init__(self, mmdet_config: str = "mmdet::detr/detr_r50_8xb2-150e_coco.py", **kwargs) -> None:
        super().__init__(mmdet_config, **kwargs)


@META_ARCH_REGISTRY.register()
class LatteRTDETR(MMDetDetector):
    """RT-DETR (HF ``RTDetrForObjectDetection`` through ``HFRTDETR``); default: the plugin's
    COCO ``rtdetr_r50vd`` mmdet config."""

    def __init__(self, mmdet_config: str = os.path.join(CONFIGS, "mmdet", "rtdetr_r50vd_latte_coco.py"),
                 **kwargs) -> None:
        super().__init__(mmdet_config, **kwargs)
