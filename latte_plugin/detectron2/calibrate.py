"""The plain function behind detectron2's :class:`LinearizeHook` and ``tools/calibrate.py``.

Like the mmdet side (and mmpretrain's ``precise_bn_hook``): unwrap DDP, take an ``islice``
of the train loader (``TrainingSampler`` never ends), run the core flow under ``no_grad``
and all-reduce its statistics across ranks through ``detectron2.utils.comm``.
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from detectron2.utils import comm

from ..console import progress
from ..core.flow import LatteConfig, calibrate_model
from ..linearize import swap_attention

__all__ = ["unwrap", "take_images", "calibrate_d2_model"]

logger = logging.getLogger("detectron2")


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DDP."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def take_images(loader: Iterable, num_images: int) -> list[list[dict]]:
    """This rank's share of ``num_images`` images as loader batches (an islice: the loader may be endless)."""
    per_rank = math.ceil(num_images / comm.get_world_size())
    batches, seen = [], 0
    for batch in itertools.islice(loader, per_rank):
        batches.append(batch)
        seen += len(batch)
        if seen >= per_rank:
            break
    if not batches:
        raise ValueError(f"empty calibration set: the calibration loader yielded no images (asked for {num_images}); "
                         "check the dataset registered for the train split")
    return batches


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if comm.get_world_size() > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def calibrate_d2_model(model: nn.Module, loader: Iterable, cfg: LatteConfig,
                       log: Optional[logging.Logger] = None) -> dict:
    """Swaps (if needed), calibrates and selects on images from ``loader``; leaves the model hybrid.

    Args:
        model: an :class:`~latte_plugin.detectron2.MMDetDetector` (DDP-wrapped or not).
        loader: a detectron2 loader over the train split (lists of dataset dicts).
        cfg: the LATTE settings.

    Returns:
        The core report (see :func:`latte_plugin.core.flow.calibrate_model`).
    """
    log = log or logger
    model = unwrap(model)
    cfg.validate()
    swap_attention(model, cfg.candidates, cfg.variant)
    batches = take_images(loader, cfg.num_images)
    # TrainingSampler deals images round-robin (the core's default); InferenceSampler gives each
    # rank a contiguous block, so pass the global positions for a rank-invariant held-out split.
    local = getattr(getattr(loader, "sampler", None), "_local_indices", None)
    positions = list(local)[: len(batches)] if local is not None and getattr(loader, "batch_size", 0) == 1 else None
    report = calibrate_model(
        model, batches, model.tensor_forward, cfg, all_reduce=_all_reduce_sum, log=log.info,
        progress=progress, shard=(comm.get_rank(), comm.get_world_size()), positions=positions,
    )
    log.info(f"[latte] linearized {len(report['linearized'])}/{len(report['candidates'])}: {report['linearized']}")
    return report
