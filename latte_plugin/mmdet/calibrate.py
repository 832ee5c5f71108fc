"""The plain functions behind :class:`LinearizeHook` and ``tools/calibrate.py``.

The hook only decides *when*; these do the work (the shape of mmpretrain's
``precise_bn_hook``): unwrap the model, take an ``islice`` of a loader built from the
train split (train samplers may be infinite), run the core flow under ``no_grad`` and
all-reduce its statistics across ranks.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch
from mmengine.dist import all_reduce, get_rank, get_world_size
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from torch import nn

from ..adapter import Adapter, calibrate, swap_attention
from ..calibration.config import LatteConfig
from .feature_cache import FeatureCache

__all__ = ["MMDetAdapter", "unwrap", "install_latte_cores", "build_calibration_loader", "resize_pipeline",
           "inner_dataset", "detector_forward", "detector_predict", "calibrate_detector"]


class MMDetAdapter(Adapter):
    """mmengine's wrappers, ranks and logger; batches are ``PackDetInputs`` dicts."""

    data_hint = "check train_dataloader.dataset (ann_file, data_prefix)"

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if is_model_wrapper(model) else model

    def world(self) -> tuple[int, int]:
        return get_rank(), get_world_size()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if get_world_size() > 1:
            all_reduce(t, op="sum")
        return t

    def forward(self, model: nn.Module):
        return detector_forward(model)

    def detect(self, model: nn.Module):
        return detector_predict(model)

    def split(self, batch: Any) -> list:
        if not isinstance(batch, dict) or not isinstance(batch.get("inputs"), (list, tuple)):
            return [batch]
        n = len(batch["inputs"])
        return [{k: (v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in batch.items()}
                for i in range(n)]

    def log(self, line: str) -> None:
        print_log(line, logger="current")

    def log_is_quiet(self) -> bool:
        return True  # mmengine's logger: the calibrate.log file under tools/calibrate.py


ADAPTER = MMDetAdapter()
unwrap = ADAPTER.unwrap


def install_latte_cores(model: nn.Module, cfg: LatteConfig) -> list[str]:
    """Installs LATTE cores in the candidate attention modules (idempotent); returns their names."""
    return swap_attention(unwrap(model), cfg.candidates, cfg.variant, cfg.backend)


def resize_pipeline(pipeline: list, size: tuple[int, int], where: str) -> None:
    """Every ``Resize`` of an mmdet pipeline to ``size`` = ``(height, width)``, in place (mmdet's
    ``scale`` is ``(width, height)``; ``keep_ratio`` stays the config's: with it, the image fits
    inside ``size``).

    Raises:
        ValueError: the pipeline has no ``Resize`` (one line naming ``where``).
    """
    steps = [t for t in pipeline if t.get("type") in ("Resize", "mmdet.Resize")]
    if not steps:
        raise ValueError(f"input_size: {where} has no Resize step to set; add one, or leave input_size unset")
    for t in steps:
        t["scale"] = (size[1], size[0])
        t.pop("scale_factor", None)


def build_calibration_loader(runner_cfg: Any, batch_size: int = 1, pipeline: str = "test", seed: int = 0,
                             input_size: Optional[tuple[int, int]] = None):
    """A loader over the **train split** for calibration, built by mmengine's own builder.

    The train dataset is kept (images, annotation file), but with ``pipeline='test'`` its
    random train-time augmentations are replaced by the test pipeline, so calibration sees
    what evaluation sees; ``input_size`` then sets its resize (:func:`resize_pipeline`). The
    sampler is mmengine's ``DefaultSampler`` (shuffled with a fixed seed), which also splits the
    images across ranks.
    """
    from mmengine.runner import Runner

    if runner_cfg.get("train_dataloader") is None:
        raise ValueError("LATTE calibration needs a train_dataloader in the config (it takes images from the train split)")
    loader_cfg = copy.deepcopy(runner_cfg["train_dataloader"])
    loader_cfg = loader_cfg.to_dict() if hasattr(loader_cfg, "to_dict") else dict(loader_cfg)
    if pipeline == "test":
        test_ds = runner_cfg["test_dataloader"]["dataset"]
        ds = inner_dataset(loader_cfg["dataset"])
        ds["pipeline"] = copy.deepcopy(test_ds["pipeline"])
        if hasattr(ds["pipeline"], "to_dict"):
            ds["pipeline"] = ds["pipeline"].to_dict()
    if input_size is not None:
        resize_pipeline(inner_dataset(loader_cfg["dataset"])["pipeline"], input_size, "the calibration pipeline")
    loader_cfg["batch_size"] = batch_size
    loader_cfg["sampler"] = dict(type="DefaultSampler", shuffle=True, seed=seed)
    loader_cfg.pop("batch_sampler", None)
    loader_cfg["num_workers"] = 0
    loader_cfg["persistent_workers"] = False
    return Runner.build_dataloader(loader_cfg, seed=seed)


def inner_dataset(dataset: dict) -> dict:
    """The dataset config that holds the pipeline, through wrappers (RepeatDataset, ...)."""
    while "dataset" in dataset and "pipeline" not in dataset:
        dataset = dataset["dataset"]
    return dataset


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, dict) or "inputs" not in batch:
        raise KeyError(
            f"calibration batches must be dicts with 'inputs' and 'data_samples' (mmdet's PackDetInputs); got "
            f"{type(batch).__name__} with keys {sorted(batch) if isinstance(batch, dict) else '-'}"
        )


def detector_forward(model: nn.Module, cache: Optional[FeatureCache] = None):
    """A ``forward(batch)`` running mmdet's data preprocessor and ``mode='tensor'`` (raw head outputs).

    The backbone and neck features of each batch come from ``cache`` (a new one if ``None``)
    where that is exact (:mod:`.feature_cache`). ``forward.uncached`` runs the whole network
    every time: what timings measure."""

    def uncached(batch: dict):
        _check_batch(batch)
        data = model.data_preprocessor(batch, False)
        return model(**data, mode="tensor")

    features = cache or FeatureCache(model)

    def forward(batch: dict):
        _check_batch(batch)
        with features.serving(batch["inputs"]):
            return uncached(batch)

    forward.uncached = uncached
    return forward


def detector_predict(model: nn.Module, cache: Optional[FeatureCache] = None):
    """A ``detect(batch)`` running mmdet's own post-processing (``mode='predict'``): one
    ``(boxes, scores, labels)`` per image, in original-image pixels (features cached as in
    :func:`detector_forward`)."""
    features = cache or FeatureCache(model)

    def detect(batch: dict) -> list:
        _check_batch(batch)
        data = model.data_preprocessor(batch, False)
        with features.serving(batch["inputs"]):
            out = model(**data, mode="predict")
        return [(p.pred_instances.bboxes, p.pred_instances.scores, p.pred_instances.labels) for p in out]

    return detect


def calibrate_detector(model: nn.Module, data: Iterable, cfg: LatteConfig) -> dict:
    """Swaps (if needed), calibrates and selects on ``data``; leaves the model hybrid.

    Args:
        model: an mmdet detector, wrapped or not.
        data: this rank's calibration batches or a train-split loader
            (:func:`build_calibration_loader`); an ``islice`` of ``cfg.num_images`` images is taken.
        cfg: LATTE settings.

    Returns:
        The core report (see :func:`latte_plugin.calibration.flow.calibrate_model`).
    """
    return calibrate(ADAPTER, model, data, cfg)
