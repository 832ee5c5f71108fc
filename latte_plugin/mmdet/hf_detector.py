"""transformers' detectors (RT-DETR, RT-DETRv2, D-FINE, DEIMv2, LW-DETR, RF-DETR, YOLOS,
Conditional and Deformable DETR) as MMDetection detectors.

mmdet 3.3 has none of the real-time DETRs. Rather than port them, :class:`HFDetector` holds
the maintained transformers implementation as ``self.hf`` and only adapts the interfaces
(the family's own pre- and post-processing live in :mod:`latte_plugin.hf.detectors`):

* inputs come from mmdet's ``DetDataPreprocessor``; the configs set its ``mean``/``std`` to
  the family's image processor (``/255`` only for RT-DETR, D-FINE; ImageNet for the others),
  and ``pixel_mask`` is built from each image's size before padding;
* ``loss`` turns ``DetDataSample`` ground truth into transformers' labels (``cx, cy, w, h``
  normalised by each image's size) and returns transformers' own loss;
* ``predict`` is the family's ``post_process_object_detection`` without its threshold,
  rescaled to the original image; ``_forward`` (``mode='tensor'``) returns ``(logits, pred_boxes)``.

Weights load offline from an HF directory (``pretrained=...``, what ``save_pretrained`` writes);
mmdet checkpoints keep transformers' parameter names under ``hf.``. The LATTE candidates are
found from the model (``candidates='auto'``, :mod:`latte_plugin.hf.discovery`).
"""
from __future__ import annotations

from typing import Optional, Union

from mmdet.models.detectors.base import BaseDetector
from mmdet.registry import MODELS
from mmdet.structures import OptSampleList, SampleList
from mmengine.structures import InstanceData
from torch import Tensor

from ..hf.detectors import (build_detector, default_top_k, detection_targets, detector_outputs, family_of, loss_logs,
                            pixel_mask_of, postprocess)
from ..hf.discovery import AttentionSite, candidate_names, detector_sites
from ..hf.rtdetr import RTDETR_CANDIDATES

__all__ = ["HFDetector", "HFRTDETR", "RTDETR_CANDIDATES"]


@MODELS.register_module()
class HFDetector(BaseDetector):
    """A transformers ``...ForObjectDetection`` as an mmdet detector.

    Args:
        family: transformers ``model_type`` (``"rt_detr"``, ``"deimv2"``, ...); read from
            ``pretrained`` when not given.
        hf_config: config keywords (dict, JSON path, or a name under ``latte_plugin/resources/architectures``);
            random initialisation.
        pretrained: a local HF checkpoint directory; loaded offline, overrides ``hf_config``.
        hf_overrides: config keys applied on top of ``pretrained`` or ``hf_config`` (e.g. ``num_labels``).
        test_cfg: ``dict(max_per_img=...)``; default: the family's image processor's (100 for
            the Deformable-DETR processor, every query otherwise).
        data_preprocessor, init_cfg: as for any mmdet detector.
    """

    def __init__(self, family: Optional[str] = None, hf_config: Union[None, dict, str] = None,
                 pretrained: Optional[str] = None, hf_overrides: Optional[dict] = None,
                 test_cfg: Optional[dict] = None, train_cfg: Optional[dict] = None,
                 data_preprocessor: Optional[dict] = None, init_cfg: Optional[dict] = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.hf = build_detector(family, hf_config, pretrained, hf_overrides)
        self.family = family_of(self.hf)
        self.test_cfg = dict(test_cfg or {})
        self.max_per_img = int(self.test_cfg.get("max_per_img", default_top_k(self.hf)))
        self.latte_sites: list[AttentionSite] = []

    def init_weights(self) -> None:
        """No-op: the HF model initialises (or loads) itself; mmengine must not re-initialise it."""

    def latte_candidates(self) -> list[str]:
        """The global softmax attention layers, found by one probe forward (``candidates='auto'``)."""
        self.latte_sites = detector_sites(self.hf, prefix="hf.")
        return candidate_names(self.latte_sites)

    # -- mmdet interface -------------------------------------------------------------------
    @staticmethod
    def _image_hw(batch_inputs: Tensor, batch_data_samples: OptSampleList) -> list[tuple[int, int]]:
        """Each image's ``(h, w)`` inside the padded batch (what the normalised boxes refer to)."""
        full = (int(batch_inputs.shape[-2]), int(batch_inputs.shape[-1]))
        if not batch_data_samples:
            return [full] * int(batch_inputs.shape[0])
        return [tuple(int(v) for v in ds.metainfo.get("img_shape", full)[:2]) for ds in batch_data_samples]

    def _run(self, batch_inputs: Tensor, batch_data_samples: OptSampleList, labels=None):
        mask = pixel_mask_of(batch_inputs, self._image_hw(batch_inputs, batch_data_samples))
        return detector_outputs(self.hf, batch_inputs, mask, labels)

    def _forward(self, batch_inputs: Tensor, batch_data_samples: OptSampleList = None) -> tuple[Tensor, Tensor]:
        """``mode='tensor'``: ``(logits (B, Q, C), pred_boxes (B, Q, 4))``."""
        out = self._run(batch_inputs, batch_data_samples)
        return out.logits, out.pred_boxes

    def extract_feat(self, batch_inputs: Tensor):
        return self._forward(batch_inputs)

    def loss(self, batch_inputs: Tensor, batch_data_samples: SampleList) -> dict:
        boxes = [ds.gt_instances.bboxes for ds in batch_data_samples]
        boxes = [b.tensor if hasattr(b, "tensor") else b for b in boxes]
        hw = self._image_hw(batch_inputs, batch_data_samples)
        labels = [detection_targets([b], [ds.gt_instances.labels], s, batch_inputs.dtype)[0]
                  for b, ds, s in zip(boxes, batch_data_samples, hw)]
        return loss_logs(self._run(batch_inputs, batch_data_samples, labels))

    def predict(self, batch_inputs: Tensor, batch_data_samples: SampleList, rescale: bool = True) -> SampleList:
        out = self._run(batch_inputs, batch_data_samples)
        return self.predict_raw(out.logits, out.pred_boxes, self._image_hw(batch_inputs, batch_data_samples),
                                batch_data_samples, rescale)

    def predict_raw(self, logits: Tensor, boxes: Tensor, image_hw, batch_data_samples: SampleList,
                    rescale: bool = True) -> SampleList:
        """The family's post-processing of raw outputs (``(B, Q, C)``, ``(B, Q, 4)``); ``image_hw``:
        one ``(h, w)`` for the whole batch or one per image (what the normalised boxes refer to)."""
        hw = [tuple(image_hw)] * len(batch_data_samples) if isinstance(image_hw[0], int) else list(image_hw)
        results = []
        for (scores, labels, bboxes), ds in zip(postprocess(self.family.scores, logits, boxes, hw, self.max_per_img),
                                                batch_data_samples):
            if rescale and "scale_factor" in ds.metainfo:
                bboxes = bboxes / bboxes.new_tensor(ds.metainfo["scale_factor"]).repeat(2)  # (w, h, w, h)
            inst = InstanceData()
            inst.bboxes, inst.scores, inst.labels = bboxes, scores, labels
            results.append(inst)
        return self.add_pred_to_datasample(batch_data_samples, results)


@MODELS.register_module()
class HFRTDETR(HFDetector):
    """RT-DETR (``RTDetrForObjectDetection``): :class:`HFDetector` with ``family='rt_detr'``."""

    def __init__(self, hf_config: Union[None, dict, str] = None, pretrained: Optional[str] = None, **kwargs) -> None:
        super().__init__("rt_detr", hf_config, pretrained, **kwargs)
