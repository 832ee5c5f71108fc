"""The plain functions behind :class:`LinearizeHook` and ``tools/calibrate.py``.

The hook only decides *when*; these do the work (the shape of mmpretrain's
``precise_bn_hook``): unwrap the model, take an ``islice`` of a loader built from the
train split (train samplers may be infinite), run the core flow under ``no_grad`` and
all-reduce its statistics across ranks.
"""
from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Iterable, Optional

import torch
from mmengine.dist import all_reduce, get_rank, get_world_size
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from torch import nn

from ..console import progress
from ..core.flow import LatteConfig, calibrate_model, find_latte_layers
from ..linearize import swap_attention

__all__ = [
    "unwrap",
    "linearize_model",
    "build_calibration_loader",
    "calibration_batches",
    "detector_forward",
    "calibrate_detector",
    "format_layer_table",
]


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DDP / mmengine wrappers."""
    return model.module if is_model_wrapper(model) else model


def linearize_model(model: nn.Module, cfg: LatteConfig) -> list[str]:
    """Installs LATTE cores in the candidate attention modules (idempotent); returns their names."""
    return swap_attention(unwrap(model), cfg.candidates, cfg.variant)


def build_calibration_loader(runner_cfg: Any, batch_size: int = 1, pipeline: str = "test", seed: int = 0):
    """A loader over the **train split** for calibration, built by mmengine's own builder.

    The train dataset is kept (images, annotation file), but with ``pipeline='test'`` its
    random train-time augmentations are replaced by the test pipeline, so calibration sees
    what evaluation sees. The sampler is mmengine's ``DefaultSampler`` (shuffled with a
    fixed seed), which also splits the images across ranks.
    """
    from mmengine.runner import Runner

    if runner_cfg.get("train_dataloader") is None:
        raise ValueError("LATTE calibration needs a train_dataloader in the config (it takes images from the train split)")
    loader_cfg = copy.deepcopy(runner_cfg["train_dataloader"])
    loader_cfg = loader_cfg.to_dict() if hasattr(loader_cfg, "to_dict") else dict(loader_cfg)
    if pipeline == "test":
        test_ds = runner_cfg["test_dataloader"]["dataset"]
        ds = loader_cfg["dataset"]
        while "dataset" in ds and "pipeline" not in ds:  # dataset wrappers (RepeatDataset, ...)
            ds = ds["dataset"]
        ds["pipeline"] = copy.deepcopy(test_ds["pipeline"])
        if hasattr(ds["pipeline"], "to_dict"):
            ds["pipeline"] = ds["pipeline"].to_dict()
    loader_cfg["batch_size"] = batch_size
    loader_cfg["sampler"] = dict(type="DefaultSampler", shuffle=True, seed=seed)
    loader_cfg.pop("batch_sampler", None)
    loader_cfg["num_workers"] = 0
    loader_cfg["persistent_workers"] = False
    return Runner.build_dataloader(loader_cfg, seed=seed)


def calibration_batches(loader: Iterable, num_images: int, batch_size: int = 1) -> list:
    """This rank's share of ``num_images`` images: an ``islice`` (train samplers may never end).

    Raises:
        ValueError: ``num_images`` smaller than the batch size (a partial batch would silently
            calibrate on more images than asked), or an empty loader.
    """
    if num_images < batch_size:
        raise ValueError(f"num_images={num_images} is smaller than the calibration batch size {batch_size}; "
                         f"ask for at least {batch_size} images or lower calib_batch_size")
    per_rank = math.ceil(num_images / get_world_size())
    batches = list(itertools.islice(loader, math.ceil(per_rank / batch_size)))
    if not batches:
        raise ValueError(
            f"empty calibration set: the train loader yielded no images (asked for {num_images}); "
            "check train_dataloader.dataset (ann_file, data_prefix)"
        )
    return batches


def detector_forward(model: nn.Module):
    """A ``forward(batch)`` running mmdet's data preprocessor and ``mode='tensor'`` (raw head outputs)."""

    def forward(batch: dict):
        if not isinstance(batch, dict) or "inputs" not in batch:
            raise KeyError(
                f"calibration batches must be dicts with 'inputs' and 'data_samples' (mmdet's PackDetInputs); got "
                f"{type(batch).__name__} with keys {sorted(batch) if isinstance(batch, dict) else '-'}"
            )
        data = model.data_preprocessor(batch, False)
        return model(**data, mode="tensor")

    return forward


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if get_world_size() > 1:
        all_reduce(t, op="sum")
    return t


def format_layer_table(report: dict) -> str:
    """A per-layer table of the calibration report, for the log."""
    rows = [f"{'layer':42s} {'sens.':>10s} {'alpha':>8s} {'delta':>9s} {'mse0':>10s} {'mse':>10s}  state"]
    for n in report["candidates"]:
        p, f = report["params"][n], report["fit"][n]
        state = "LINEAR" if n in report["linearized"] else "exact"
        rows.append(f"{n:42s} {report['sensitivity'][n]:10.4e} {p['alpha']:8.4f} {p['delta_q']:9.4g} "
                    f"{f['mse_initial']:10.3e} {f['mse_final']:10.3e}  {state}")
    return "\n".join(rows)


@torch.no_grad()
def calibrate_detector(
    model: nn.Module, batches: list, cfg: LatteConfig, logger: Optional[str] = "current"
) -> dict:
    """Swaps (if needed), calibrates and selects on ``batches``; leaves the model hybrid.

    Args:
        model: an mmdet detector, wrapped or not.
        batches: this rank's calibration batches (see :func:`calibration_batches`).
        cfg: LATTE settings.

    Returns:
        The core report (see :func:`latte_plugin.core.flow.calibrate_model`).
    """
    model = unwrap(model)
    linearize_model(model, cfg)
    report = calibrate_model(
        model,
        batches,
        detector_forward(model),
        cfg,
        all_reduce=_all_reduce_sum,
        log=lambda s: print_log(s, logger=logger),
        progress=progress,
        shard=(get_rank(), get_world_size()),
    )
    print_log("[latte] per-layer calibration:\n" + format_layer_table(report), logger=logger)
    return report
