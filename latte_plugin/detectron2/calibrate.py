"""The plain function behind detectron2's :class:`LinearizeHook`, the meta-architectures'
self-calibration and ``tools/calibrate.py``.

Like the mmdet side (and mmpretrain's ``precise_bn_hook``): unwrap DDP, take an ``islice``
of the train loader (``TrainingSampler`` never ends), run the core flow under ``no_grad``
and all-reduce its statistics across ranks through ``detectron2.utils.comm``.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from detectron2.utils import comm

from ..adapter import Adapter, calibrate
from ..calibration.config import LatteConfig

__all__ = ["Detectron2Adapter", "unwrap", "calibrate_detector"]

logger = logging.getLogger("detectron2")


class Detectron2Adapter(Adapter):
    """detectron2's ranks (``comm``) and logger; batches are lists of dataset dicts, run
    through the meta-architecture's ``tensor_forward`` (raw head outputs) and ``predict``
    (its own post-processing, for ``target=``)."""

    data_hint = "check the dataset registered for the train split"

    def world(self) -> tuple[int, int]:
        return comm.get_rank(), comm.get_world_size()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if comm.get_world_size() > 1:
            dist.all_reduce(t)
        return t

    def forward(self, model: nn.Module):
        # the mmdet bridge caches backbone features; the other meta-architectures run the whole network
        return model.calibration_forward() if hasattr(model, "calibration_forward") else model.tensor_forward

    def detect(self, model: nn.Module):
        def detect(batch: list[dict]) -> list:
            return [(r["instances"].pred_boxes.tensor, r["instances"].scores, r["instances"].pred_classes)
                    for r in model.predict(batch)]

        return detect if hasattr(model, "predict") else None

    def split(self, batch: Any) -> list:
        return [[d] for d in batch]

    def sample_positions(self, data: Any) -> Optional[Sequence[int]]:
        # TrainingSampler deals images round-robin (None); InferenceSampler (the COCO configs'
        # calibration_loader) gives each rank a contiguous block: its dataset indices are global
        local = getattr(getattr(data, "sampler", None), "_local_indices", None)
        return None if local is None else list(local)

    def log(self, line: str) -> None:
        logger.info(line)

    def log_is_quiet(self) -> bool:
        return True  # detectron2's logger: the calibrate.log file under tools/calibrate.py


ADAPTER = Detectron2Adapter()
unwrap = ADAPTER.unwrap


def calibrate_detector(model: nn.Module, data: Iterable, cfg: LatteConfig) -> dict:
    """Swaps (if needed), calibrates and selects on images from ``data``; leaves the model hybrid.

    Args:
        model: a LATTE meta-architecture (:class:`~latte_plugin.detectron2.LatteRTDETR`,
            :class:`~latte_plugin.detectron2.MMDetDetector`), DDP-wrapped or not.
        data: a detectron2 loader over the train split (lists of dataset dicts); an ``islice``
            of ``cfg.num_images`` images is taken.
        cfg: the LATTE settings.

    Returns:
        The core report (see :func:`latte_plugin.calibration.flow.calibrate_model`).
    """
    return calibrate(ADAPTER, model, data, cfg)
