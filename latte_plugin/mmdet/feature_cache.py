"""The backbone features of each calibration batch, computed once per calibration.

Calibration runs the same few images through the detector dozens of times (fits, searches,
judged configurations, the signal check) and only attention layers of the transformer change
between the runs. Where the backbone (and neck) holds no candidate its output for a batch is the
same every time; on DETR-R50 it is about half of a forward.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from ..nn.install import find_latte_layers

__all__ = ["FeatureCache", "cache_site"]


def cache_site(model: nn.Module) -> Optional[tuple[nn.Module, str]]:
    """``(module, method)`` computing features no LATTE layer changes, or ``None``.

    mmdet's own DETR family: ``model.extract_feat`` (backbone, then neck), where its
    ``extract_feat`` is mmdet's and neither holds a LATTE layer; the HF wrappers:
    ``hf.model.backbone.forward``, where the backbone holds none (not a ViT backbone with
    candidates, say).
    """
    names = list(find_latte_layers(model))
    try:
        from mmdet.models.detectors.base_detr import DetectionTransformer
    except ImportError:  # pragma: no cover - mmdet is this adapter's framework
        return None
    if isinstance(model, DetectionTransformer) and type(model).extract_feat is DetectionTransformer.extract_feat:
        owner, method, prefixes = model, "extract_feat", ("backbone.", "neck.")
    else:
        backbone = getattr(getattr(getattr(model, "hf", None), "model", None), "backbone", None)
        if not isinstance(backbone, nn.Module):
            return None
        owner, method, prefixes = backbone, "forward", ("hf.model.backbone.",)
    return None if any(n.startswith(prefixes) for n in names) else (owner, method)


def _nbytes(feats: Any) -> int:
    if isinstance(feats, torch.Tensor):
        return feats.numel() * feats.element_size()
    if isinstance(feats, (tuple, list)):
        return sum(_nbytes(f) for f in feats)
    return 0


class FeatureCache:
    """The outputs of :func:`cache_site`'s method, keyed by the identity of a batch's input images.

    Serves only under ``no_grad`` in eval mode, on models that have a site; otherwise every call
    runs the backbone. The ``i``-th call within one forward answers with the ``i``-th output cached
    for the batch (a model calling its backbone twice gets both). Holds at most ``limit_bytes`` of
    features (least recently used dropped first), each entry with a reference to its input
    images, so that an id is never reused while it is cached.
    """

    def __init__(self, model: nn.Module, limit_bytes: int = 1 << 30):
        self.model, self.limit_bytes = model, limit_bytes
        self.site = cache_site(model)
        self.entries: OrderedDict[tuple, tuple[list, list]] = OrderedDict()

    @contextmanager
    def serving(self, images: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the block the site answers from the cache for the batch whose input images
        (before the data preprocessor) are ``images``."""
        if self.site is None or torch.is_grad_enabled() or self.model.training:
            yield
            return
        owner, method = self.site
        inputs = list(images)
        key = tuple(id(x) for x in inputs)
        hit = self.entries.get(key)
        outputs = hit[1] if hit is not None and all(a is b for a, b in zip(hit[0], inputs)) else []
        self.entries[key] = (inputs, outputs)
        self.entries.move_to_end(key)
        compute, calls = getattr(owner, method), [0]

        def cached(*args, **kwargs):
            i, calls[0] = calls[0], calls[0] + 1
            if i == len(outputs):
                outputs.append(compute(*args, **kwargs))
                self._trim()
            return outputs[i]

        setattr(owner, method, cached)  # an instance attribute shadows the method for this block
        try:
            yield
        finally:
            delattr(owner, method)

    def _trim(self) -> None:
        while len(self.entries) > 1 and sum(_nbytes(o) for _, o in self.entries.values()) > self.limit_bytes:
            self.entries.popitem(last=False)
