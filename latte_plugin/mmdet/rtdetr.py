"""RT-DETR as an MMDetection detector, wrapping HF ``transformers``' ``RTDetrForObjectDetection``.

mmdet 3.3.0 has no RT-DETR. Rather than port the architecture, the detector holds the
maintained HF implementation as ``self.hf`` and only adapts the interfaces:

* inputs come from mmdet's ``DetDataPreprocessor`` (RT-DETR expects RGB in ``[0, 1]``, so the
  config uses ``mean=0, std=255, bgr_to_rgb=True``);
* ``loss`` turns ``DetDataSample`` ground truth into HF labels (normalised ``cx, cy, w, h``)
  and returns HF's own loss (VFL + L1 + GIoU with denoising and auxiliary terms);
* ``predict`` is HF's ``post_process_object_detection`` (sigmoid scores, top-k over
  queries x classes), rescaled to the original image and packed as ``InstanceData``;
* ``_forward`` (``mode='tensor'``) returns ``(logits, pred_boxes)``.

Weights load offline from an HF checkpoint directory (``config.json`` +
``model.safetensors``) with ``pretrained=...``; mmdet checkpoints of this detector keep
HF's parameter names under the ``hf.`` prefix. LATTE candidates are the AIFI encoder
self-attention ``hf.model.encoder.aifi.*.layers.*.self_attn`` and the decoder
self-attention ``hf.model.decoder.layers.*.self_attn``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from mmdet.models.detectors.base import BaseDetector
from mmdet.registry import MODELS
from mmdet.structures import OptSampleList, SampleList
from mmengine.structures import InstanceData
from torch import Tensor

from ..hf.rtdetr import RTDETR_CANDIDATES, build_rtdetr, rtdetr_postprocess, rtdetr_targets

__all__ = ["HFRTDETR", "rtdetr_postprocess", "RTDETR_CANDIDATES"]


@MODELS.register_module()
class HFRTDETR(BaseDetector):
    """RT-DETR (HF ``RTDetrForObjectDetection``) as an mmdet detector.

    Args:
        hf_config: keyword arguments of ``transformers.RTDetrConfig``, or the path of a JSON
            file holding them (random initialisation).
        pretrained: a local HF checkpoint directory; loaded offline, overrides ``hf_config``
            except for keys given in ``hf_overrides``.
        hf_overrides: config keys applied on top of ``pretrained`` (e.g. ``num_labels``).
        test_cfg: ``dict(max_per_img=...)``; defaults to the number of queries (as HF).
        data_preprocessor, init_cfg: as for any mmdet detector.
    """

    def __init__(
        self,
        hf_config: Union[None, dict, str] = None,
        pretrained: Optional[str] = None,
        hf_overrides: Optional[dict] = None,
        test_cfg: Optional[dict] = None,
        train_cfg: Optional[dict] = None,
        data_preprocessor: Optional[dict] = None,
        init_cfg: Optional[dict] = None,
    ) -> None:
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.hf = build_rtdetr(hf_config, pretrained, hf_overrides)
        self.test_cfg = dict(test_cfg or {})
        self.max_per_img = int(self.test_cfg.get("max_per_img", self.hf.config.num_queries))

    def init_weights(self) -> None:
        """No-op: the HF model initialises (or loads) itself; mmengine must not re-initialise it."""

    # -- mmdet interface -------------------------------------------------------------------
    @staticmethod
    def _input_hw(batch_inputs: Tensor) -> tuple[int, int]:
        return int(batch_inputs.shape[-2]), int(batch_inputs.shape[-1])

    def _labels(self, batch_inputs: Tensor, batch_data_samples: SampleList) -> list[dict]:
        """mmdet ground truth -> HF labels: boxes normalised by the network input size."""
        boxes = [ds.gt_instances.bboxes for ds in batch_data_samples]
        boxes = [b.tensor if hasattr(b, "tensor") else b for b in boxes]
        labels = [ds.gt_instances.labels for ds in batch_data_samples]
        return rtdetr_targets(boxes, labels, self._input_hw(batch_inputs), batch_inputs.dtype)

    def _forward(self, batch_inputs: Tensor, batch_data_samples: OptSampleList = None) -> tuple[Tensor, Tensor]:
        """``mode='tensor'``: ``(logits (B, Q, C), pred_boxes (B, Q, 4))``."""
        out = self.hf(pixel_values=batch_inputs)
        return out.logits, out.pred_boxes

    def extract_feat(self, batch_inputs: Tensor):
        return self.hf.model.backbone(batch_inputs, torch.ones_like(batch_inputs[:, 0], dtype=torch.long))

    def loss(self, batch_inputs: Tensor, batch_data_samples: SampleList) -> dict:
        out = self.hf(pixel_values=batch_inputs, labels=self._labels(batch_inputs, batch_data_samples))
        logs = {"loss": out.loss}
        # logged, not summed (mmengine sums keys containing 'loss')
        for key in ("loss_vfl", "loss_bbox", "loss_giou"):
            if key in out.loss_dict:
                logs[key.replace("loss_", "")] = out.loss_dict[key].detach()
        return logs

    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList, rescale: bool = True) -> SampleList:
        logits, boxes = self._forward(batch_inputs)
        return self.predict_raw(logits, boxes, self._input_hw(batch_inputs), batch_data_samples, rescale)

    def predict_raw(self, logits: Tensor, boxes: Tensor, input_hw: tuple[int, int], batch_data_samples: SampleList,
                    rescale: bool = True) -> SampleList:
        """HF's post-processing of raw outputs (``(B, Q, C)``, ``(B, Q, 4)``) for a network input of ``input_hw``."""
        hw = [input_hw] * len(batch_data_samples)
        results = []
        for (scores, labels, bboxes), ds in zip(rtdetr_postprocess(logits, boxes, hw, self.max_per_img),
                                                batch_data_samples):
            if rescale and "scale_factor" in ds.metainfo:
                sf = bboxes.new_tensor(ds.metainfo["scale_factor"]).repeat(2)  # (w, h, w, h)
                bboxes = bboxes / sf
            inst = InstanceData()
            inst.bboxes, inst.scores, inst.labels = bboxes, scores, labels
            results.append(inst)
        return self.add_pred_to_datasample(batch_data_samples, results)
