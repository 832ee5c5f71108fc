"""What ``tools/calibrate.py`` does for a detectron2 LazyConfig, as a function (tests call it too).

The same steps, options and artifacts as :mod:`latte_plugin.mmdet.workflow`; ``evaluate``
numbers come from detectron2's ``inference_on_dataset`` with the config's evaluator
(``COCOEvaluator``).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from ..artifacts import write_artifacts
from ..calibration.config import LatteConfig
from ..nn.install import find_latte_layers, set_modes
from ..storage import check_checkpoint, check_readable
from .calibrate import calibrate_detector, unwrap
from .data import resize_augmentations

__all__ = ["load_config", "evaluate_bbox", "run_calibration"]


def load_config(path: str, opts: Sequence[str] = ()):
    """``LazyConfig.load`` with dotted ``key=value`` overrides."""
    from detectron2.config import LazyConfig

    cfg = LazyConfig.load(path)
    return LazyConfig.apply_overrides(cfg, list(opts))


def evaluate_bbox(cfg, model, linear: Sequence[str], mode: str = "linear") -> dict:
    """The config's test loader and evaluator through ``inference_on_dataset`` with ``linear``
    layers in ``mode``, the rest exact: ``{bbox_mAP, bbox_mAP_50}`` in [0, 1]."""
    from detectron2.config import instantiate
    from detectron2.evaluation import inference_on_dataset

    set_modes(find_latte_layers(unwrap(model)), linear, mode)
    res = inference_on_dataset(model, instantiate(cfg.dataloader.test), instantiate(cfg.dataloader.evaluator))
    bbox = res["bbox"]
    return {"bbox_mAP": float(bbox["AP"]) / 100.0, "bbox_mAP_50": float(bbox["AP50"]) / 100.0}


def _latte_settings(cfg, config: str, overrides: Optional[dict]) -> LatteConfig:
    latte = dict(cfg.model.get("latte") or {})
    if not latte:
        raise ValueError(f"{config} sets no model.latte; use a LATTE config or override model.latte.candidates=[...]")
    latte.pop("calibrate", None)
    latte.update(overrides or {})
    return LatteConfig.from_dict(latte)


def _build_model(cfg, checkpoint: Optional[str]):
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import instantiate

    model = instantiate(cfg.model)
    model.to(cfg.train.get("device", "cpu"))
    ckpt = checkpoint or cfg.train.get("init_checkpoint") or ""
    if ckpt:
        check_readable(ckpt)
        if not model.allow_partial_load and ckpt.endswith(".pth"):
            check_checkpoint(model, ckpt, "model.allow_partial_load=True / --allow-partial-load")  # keys and shapes
        DetectionCheckpointer(model).load(ckpt)
    return model.eval()


def run_calibration(config: str, checkpoint: Optional[str] = None, work_dir: Optional[str] = None,
                    overrides: Optional[dict] = None, evaluate: bool = False, opts: Sequence[str] = (),
                    allow_partial_load: bool = False) -> dict:
    """Builds the LazyConfig's model, loads the checkpoint, calibrates on ``model.calibration_loader``
    (the train split), saves, and optionally evaluates exact and hybrid with ``COCOEvaluator``."""
    cfg = load_config(config, opts)
    latte_cfg = _latte_settings(cfg, config, overrides)
    if latte_cfg.input_size is not None:  # calibrated, timed and evaluated where it is deployed
        for key, node in (("model.calibration_loader", cfg.model.get("calibration_loader")),
                          ("dataloader.test", cfg.dataloader.test)):
            if node is not None:
                resize_augmentations(node.mapper.augmentations, latte_cfg.input_size, f"{config}'s {key}.mapper.augmentations")
    cfg.model.latte = dict(latte_cfg.to_dict(), calibrate="never")  # this function calibrates, not the model
    cfg.model.allow_partial_load = bool(allow_partial_load)
    model = _build_model(cfg, checkpoint)
    loader = model.calibration_loader()
    if loader is None:
        raise ValueError("the config gives no model.calibration_loader (train-split images for calibration)")
    report = calibrate_detector(model, loader, latte_cfg)
    work_dir = work_dir or os.path.join("work_dirs", os.path.splitext(os.path.basename(config))[0])
    return write_artifacts(unwrap(model), report, work_dir, "detectron2",
                           (lambda linear: evaluate_bbox(cfg, model, linear, latte_cfg.mode)) if evaluate else None)
