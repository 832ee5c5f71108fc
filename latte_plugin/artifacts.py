"""What every framework's calibration job leaves in its work dir, written by one function:
``latte_calibrated.pth``, ``latte_report.json`` (with exact vs hybrid mAP when evaluated)
and ``latte_sensitivity.png``."""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from torch import nn

from .storage import CKPT_NAME, REPORT_NAME, atomic_write_json, save_calibrated_checkpoint
from .viz import plot_sensitivity, plot_speed_front

__all__ = ["write_artifacts"]

#: ``evaluate(linear)``: puts ``linear`` layers in the calibrated mode (the rest exact) and
#: returns ``{bbox_mAP, bbox_mAP_50}`` from the framework's own evaluator.
Evaluate = Callable[[Sequence[str]], dict]


def write_artifacts(model: nn.Module, report: dict, work_dir: str, framework: str,
                    evaluate: Optional[Evaluate] = None, main_process: bool = True) -> dict:
    """Saves the calibrated checkpoint, evaluates exact then hybrid, plots and writes the report.

    Args:
        model: the bare calibrated model. report: the core report (extended in place).
        work_dir: where the files go. framework: ``'mmdet'`` or ``'detectron2'``.
        evaluate: see :data:`Evaluate`; the model is left hybrid. ``None``: no evaluation.
        main_process: only the main process writes (every rank holds the same state).

    Returns:
        ``report`` with ``paths``, ``framework`` and, when evaluated, ``metrics`` and ``retained``.
    """
    os.makedirs(work_dir, exist_ok=True)
    paths = {"report": os.path.join(work_dir, REPORT_NAME), "checkpoint": os.path.join(work_dir, CKPT_NAME)}
    if main_process:
        save_calibrated_checkpoint(model, report, paths["checkpoint"])
    if evaluate is not None:
        exact = evaluate([])
        lin = evaluate(list(report["linearized"]))
        report["metrics"] = {"exact": exact, "linearized": lin}
        report["retained"] = lin["bbox_mAP"] / exact["bbox_mAP"] if exact["bbox_mAP"] > 0 else float("nan")
    report["paths"], report["framework"] = paths, framework
    if main_process:
        plot = plot_sensitivity(report, os.path.join(work_dir, "latte_sensitivity.png"))
        if plot:
            paths["sensitivity_plot"] = plot
        front = plot_speed_front(report["speed"], os.path.join(work_dir, "latte_speed_front.png")) if "speed" in report else None
        if front:
            paths["speed_front_plot"] = front
        atomic_write_json(report, paths["report"])
    return report
