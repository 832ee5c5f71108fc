"""What ``tools/calibrate.py`` does for an mmdet config, as a function (tests call it too)."""
from __future__ import annotations

import copy
import os
from typing import Optional, Sequence

import torch

from ..core.flow import find_latte_layers, set_modes
from ..core import io as core_io
from ..core.io import CKPT_NAME, REPORT_NAME, atomic_write_json, check_readable
from ..viz import plot_sensitivity
from .calibrate import unwrap

__all__ = ["run_calibration", "evaluate_bbox", "save_calibrated_checkpoint"]


def _bbox(metrics: dict) -> dict:
    def get(key: str) -> float:
        for k, v in metrics.items():
            if k.endswith(key):
                return float(v)
        raise KeyError(f"the evaluator reported no '{key}' (got {sorted(metrics)}); is it mmdet's CocoMetric?")

    return {"bbox_mAP": get("bbox_mAP"), "bbox_mAP_50": get("bbox_mAP_50")}


def evaluate_bbox(runner, linear: Sequence[str], mode: str = "linear") -> dict:
    """Runs the Runner's own test loop (its evaluator) with ``linear`` layers in ``mode``, the rest exact."""
    layers = find_latte_layers(unwrap(runner.model))
    set_modes(layers, linear, mode)
    return _bbox(runner.test())


def save_calibrated_checkpoint(model: torch.nn.Module, report: dict, path: str) -> None:
    """:func:`latte_plugin.core.io.save_calibrated_checkpoint` of the model inside mmengine's wrappers."""
    core_io.save_calibrated_checkpoint(unwrap(model), report, path)


def run_calibration(
    config: str,
    checkpoint: Optional[str] = None,
    work_dir: Optional[str] = None,
    overrides: Optional[dict] = None,
    evaluate: bool = False,
    cfg_options: Sequence[str] = (),
    launcher: str = "none",
    allow_partial_load: bool = False,
) -> dict:
    """Builds the config's Runner, calibrates through its :class:`LinearizeHook`, saves, and evaluates.

    Returns:
        The report (also written to ``WORK_DIR/latte_report.json``) with ``metrics``,
        ``retained`` and ``paths`` when evaluated.
    """
    from mmengine.config import Config, DictAction
    from mmengine.runner import Runner

    from .hook import LinearizeHook

    cfg = Config.fromfile(config)
    if cfg_options:
        parser_action = DictAction(option_strings=[], dest="x")
        opts = {}
        for kv in cfg_options:
            k, v = kv.split("=", 1)
            opts[k] = parser_action._parse_iterable(v)
        cfg.merge_from_dict(opts)
    hooks = list(cfg.get("custom_hooks", []) or [])
    idx = [i for i, h in enumerate(hooks) if h.get("type") in ("LinearizeHook", LinearizeHook)]
    if not idx:
        raise ValueError(f"{config} has no LinearizeHook in custom_hooks; inherit a latte config or add one")
    hook_cfg = copy.deepcopy(hooks[idx[0]])
    hook_cfg.update(overrides or {})
    hook_cfg["calibrate"] = "always"
    hook_cfg["allow_partial_load"] = bool(allow_partial_load)
    hooks[idx[0]] = hook_cfg
    cfg.custom_hooks = hooks
    cfg.work_dir = work_dir or cfg.get("work_dir") or os.path.join(
        "work_dirs", os.path.splitext(os.path.basename(config))[0])
    if checkpoint:
        check_readable(checkpoint)
        cfg.load_from = checkpoint
    if launcher == "pytorch" and not torch.cuda.is_available():
        # mmengine's init_dist calls torch.cuda.set_device; on CPU-only machines start gloo from
        # torchrun's environment ourselves: mmengine's dist utilities and DefaultSampler use it.
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        launcher = "none"
    cfg.launcher = launcher
    runner = Runner.from_cfg(cfg)
    hook = LinearizeHook.find(runner)
    hook.before_run(runner)
    runner.load_or_resume()
    report = hook.run_calibration(runner)
    hook.calibrate = "never"  # later test() calls reuse this state

    ckpt_path = os.path.join(runner.work_dir, CKPT_NAME)
    report_path = os.path.join(runner.work_dir, REPORT_NAME)
    from mmengine.dist import is_main_process

    if is_main_process():  # every rank holds the same state; one writes it
        save_calibrated_checkpoint(runner.model, report, ckpt_path)
    if evaluate:
        linear, mode = list(report["linearized"]), hook.latte_cfg.mode
        exact = evaluate_bbox(runner, [])
        lin = evaluate_bbox(runner, linear, mode)
        set_modes(find_latte_layers(unwrap(runner.model)), linear, mode)
        report["metrics"] = {"exact": exact, "linearized": lin}
        report["retained"] = lin["bbox_mAP"] / exact["bbox_mAP"] if exact["bbox_mAP"] > 0 else float("nan")
    report["paths"] = {"report": report_path, "checkpoint": ckpt_path}
    if is_main_process():
        plot = plot_sensitivity(report, os.path.join(runner.work_dir, "latte_sensitivity.png"))
        if plot:
            report["paths"]["sensitivity_plot"] = plot
        atomic_write_json(report, report_path)
    return report
