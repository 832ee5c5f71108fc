"""The bridge from Detectron2 to mmdet-built detectors: the one module of the Detectron2 adapter
that imports mmengine, mmdet and ``latte_plugin.mmdet`` (lazily, when such a model is built).

:class:`MMDetDetector` runs any mmdet detector config as a detectron2 meta-architecture (same
implementation and checkpoints as the mmdet side); :class:`LatteDETR` is DETR-R50's. The
transformers detectors (:class:`~latte_plugin.detectron2.meta_arch.LatteHFDetector`) need neither.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn

from detectron2.modeling import META_ARCH_REGISTRY

from .meta_arch import LatteMetaArch, _plain

__all__ = ["MMDetDetector", "LatteDETR"]


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
class MMDetDetector(LatteMetaArch):
    """An mmdet detector in detectron2's interface (needs mmdet; RT-DETR does not: :class:`LatteRTDETR`).

    Args:
        mmdet_config: path of the mmdet config whose ``model`` is built (the same config and
            checkpoint as on the mmdet side), or ``mmdet::<path>`` for one shipped with mmdet.
        model_overrides: keys merged into the mmdet model config.
        latte, calibration_loader, allow_partial_load: see :class:`LatteMetaArch`.
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
        det = _build_mmdet_model(mmdet_config, _plain(model_overrides))
        for name, child in det.named_children():  # mmdet's keys, so checkpoints are shared
            self.add_module(name, child)
        object.__setattr__(self, "_det", det)  # the same modules, not registered twice
        self._setup_latte(latte, calibration_loader, allow_partial_load)

    def train(self, mode: bool = True) -> "MMDetDetector":
        super().train(mode)
        self._det.training = mode  # the wrapped detector object itself (its children are ours)
        return self

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

    def calibration_forward(self):
        """:meth:`tensor_forward` with each batch's backbone features computed once
        (``latte_plugin/mmdet/feature_cache.py``); ``.uncached`` is the whole network (for timings)."""
        from ..mmdet.feature_cache import FeatureCache

        features = FeatureCache(self._det)

        def forward(batched_inputs: list[dict]):
            with features.serving([d["image"] for d in batched_inputs]):
                return self.tensor_forward(batched_inputs)

        forward.uncached = self.tensor_forward
        return forward

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
        return self.predict(batched_inputs)

    def predict(self, batched_inputs: list[dict]) -> list[dict]:
        """Inference as it is (no calibration first): ``[{"instances": Instances}]`` in original-image pixels."""
        data = self.to_mmdet(batched_inputs, False)
        preds = self._det(**data, mode="predict")
        return [{"instances": self.to_instances(p.pred_instances.bboxes, p.pred_instances.scores,
                                                p.pred_instances.labels, int(d.get("height", p.ori_shape[0])),
                                                int(d.get("width", p.ori_shape[1])))}
                for p, d in zip(preds, batched_inputs)]


@META_ARCH_REGISTRY.register()
class LatteDETR(MMDetDetector):
    """DETR-family detector (mmdet's DETR / Conditional / DAB-DETR); default: DETR-R50 on COCO."""

    def __init__(self, mmdet_config: str = "mmdet::detr/detr_r50_8xb2-150e_coco.py", **kwargs) -> None:
        super().__init__(mmdet_config, **kwargs)
