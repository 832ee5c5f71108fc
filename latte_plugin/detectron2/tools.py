"""What ``tools/calibrate.py`` does for a detectron2 LazyConfig, as a function (tests call it too).

Same outputs as the mmdet side: ``latte_calibrated.pth`` (``meta`` + ``state_dict`` +
``model``, tensors and plain types only) and ``latte_report.json``; ``--eval`` numbers come
from detectron2's ``inference_on_dataset`` with the config's evaluator (``COCOEvaluator``).
"""
from __future__ import annotations

import copy
import os
from typing import Optional, Sequence

import torch

from ..core.flow import LatteConfig, find_latte_layers, set_modes
from ..core.io import CKPT_NAME, REPORT_NAME, atomic_write_json, check_readable, save_calibrated_checkpoint
from ..viz import plot_sensitivity
from .calibrate import calibrate_d2_model, unwrap

__all__ = ["load_lazy_config", "evaluate_d2", "run_calibration_d2"]


def load_lazy_config(path: str, opts: Sequence[str] = ()):
    from detectron2.config import LazyConfig

    cfg = LazyConfig.load(path)
    return LazyConfig.apply_overrides(cfg, list(opts))


def evaluate_d2(cfg, model) -> dict:
    """The config's test loader and evaluator through ``inference_on_dataset``: ``{bbox_mAP, bbox_mAP_50}`` in [0, 1]."""
    from detectron2.config import instantiate
    from detectron2.evaluation import inference_on_dataset

    res = inference_on_dataset(model, instantiate(cfg.dataloader.test), instantiate(cfg.dataloader.evaluator))
    bbox = res["bbox"]
    return {"bbox_mAP": float(bbox["AP"]) / 100.0, "bbox_mAP_50": float(bbox["AP50"]) / 100.0}


def run_calibration_d2(
    config: str,
    checkpoint: Optional[str] = None,
    work_dir: Optional[str] = None,
    overrides: Optional[dict] = None,
    evaluate: bool = False,
    opts: Sequence[str] = (),
    allow_partial_load: bool = False,
) -> dict:
    """Builds the LazyConfig's model, loads the checkpoint, calibrates on ``model.calibration_loader``
    (the train split), saves, and optionally evaluates exact and linearized with ``COCOEvaluator``."""
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import instantiate

    cfg = load_lazy_config(config, opts)
    latte = dict(cfg.model.get("latte") or {})
    if not latte:
        raise ValueError(f"{config} sets no model.latte; use a LATTE config or override model.latte.candidates=[...]")
    latte.pop("calibrate", None)
    latte.update(overrides or {})
    latte_cfg = LatteConfig.from_dict(latte)
    cfg.model.latte = dict(latte_cfg.to_dict(), calibrate="never")
    cfg.model.allow_partial_load = bool(allow_partial_load)
    model = instantiate(cfg.model)
    model.to(cfg.train.get("device", "cpu"))
    ckpt = checkpoint or cfg.train.get("init_checkpoint") or ""
    if ckpt:
        check_readable(ckpt)
        DetectionCheckpointer(model).load(ckpt)
    model.eval()
    loader = model._calibration_loader
    if loader is None:
        raise ValueError("the config gives no model.calibration_loader (train-split images for calibration)")
    report = calibrate_d2_model(model, loader, latte_cfg)

    work_dir = work_dir or os.path.join("work_dirs", os.path.splitext(os.path.basename(config))[0])
    os.makedirs(work_dir, exist_ok=True)
    ckpt_path = os.path.join(work_dir, CKPT_NAME)
    report_path = os.path.join(work_dir, REPORT_NAME)
    save_calibrated_checkpoint(unwrap(model), report, ckpt_path)
    if evaluate:
        layers = find_latte_layers(model)
        linear = list(report["linearized"])
        set_modes(layers, [])
        exact = evaluate_d2(cfg, model)
        set_modes(layers, linear, latte_cfg.mode)
        lin = evaluate_d2(cfg, model)
        report["metrics"] = {"exact": exact, "linearized": lin}
        report["retained"] = lin["bbox_mAP"] / exact["bbox_mAP"] if exact["bbox_mAP"] > 0 else float("nan")
    report["paths"] = {"report": report_path, "checkpoint": ckpt_path}
    plot = plot_sensitivity(report, os.path.join(work_dir, "latte_sensitivity.png"))
    if plot:
        report["paths"]["sensitivity_plot"] = plot
    report["framework"] = "detectron2"
    atomic_write_json(report, report_path)
    return report
