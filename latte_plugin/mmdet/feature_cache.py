"""The backbone and neck features of each calibration batch, computed once per calibration.

Calibration runs the same few images through the detector dozens of times (fits, searches,
judged configurations, the signal check) and only attention layers of the transformer change
between the runs. On mmdet's own DETR-family detectors the backbone and neck hold no candidate,
so their output for a batch is the same every time; it is about half of a DETR-R50 forward.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..nn.install import find_latte_layers

__all__ = ["FeatureCache", "backbone_is_fixed"]


def backbone_is_fixed(model: nn.Module) -> bool:
    """Whether ``model.extract_feat`` is mmdet's own (backbone, then neck) and no LATTE layer
    lives in either: only then is its output independent of the layers' modes."""
    try:
        from mmdet.models.detectors.base_detr import DetectionTransformer
    except ImportError:  # pragma: no cover - mmdet is this adapter's framework
        return False
    if not isinstance(model, DetectionTransformer) or type(model).extract_feat is not DetectionTransformer.extract_feat:
        return False
    return not any(name.startswith(("backbone.", "neck.")) for name in find_latte_layers(model))


def _nbytes(feats: Any) -> int:
    tensors = feats if isinstance(feats, (tuple, list)) else [feats]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class FeatureCache:
    """``extract_feat`` outputs keyed by the identity of a batch's input images.

    Serves only under ``no_grad`` in eval mode, on models :func:`backbone_is_fixed` accepts;
    otherwise every call runs the backbone. Holds at most ``limit_bytes`` of features (least
    recently used dropped first), each entry with a reference to its input tensors, so that an id
    is never reused while it is cached.
    """

    def __init__(self, model: nn.Module, limit_bytes: int = 1 << 30):
        self.model, self.limit_bytes = model, limit_bytes
        self.usable = backbone_is_fixed(model)
        self.entries: OrderedDict[tuple, tuple[list, Any]] = OrderedDict()

    @contextmanager
    def serving(self, images: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the block, ``model.extract_feat`` answers from the cache for the batch whose
        input images (before the data preprocessor) are ``images``."""
        if not (self.usable and not torch.is_grad_enabled() and not self.model.training):
            yield
            return
        inputs = list(images)
        key = tuple(id(x) for x in inputs)
        compute = self.model.extract_feat

        def extract_feat(batch_inputs: torch.Tensor):
            hit = self.entries.get(key)
            if hit is not None and all(a is b for a, b in zip(hit[0], inputs)):
                self.entries.move_to_end(key)
                return hit[1]
            feats = compute(batch_inputs)
            self.entries[key] = (inputs, feats)
            while len(self.entries) > 1 and sum(_nbytes(f) for _, f in self.entries.values()) > self.limit_bytes:
                self.entries.popitem(last=False)
            return feats

        self.model.extract_feat = extract_feat  # an instance attribute shadows the method for this block
        try:
            yield
        finally:
            del self.model.extract_feat
