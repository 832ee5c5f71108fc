"""The main job's rows: one Runner, one set of calibration images, many LATTE settings.

Each row recalibrates the scalars under its own settings (variant, sigma, sequential,
selection, ratio) through the same :func:`calibrate_detector`, then evaluates with the
Runner's own test loop (mmdet's ``CocoMetric``). Encoder latency is timed side by side
on the same batch for the exact model and for the row's hybrid.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Callable, Optional

import torch
from mmengine.logging import print_log

from ..core.flow import LatteConfig, attention_gflops, find_latte_layers, set_modes
from .calibrate import calibrate_detector, detector_forward, unwrap
from .tools import evaluate_bbox

__all__ = ["ROWS", "DEFAULT_ROW", "Row", "run_rows", "encoder_latency"]


@dataclasses.dataclass
class Row:
    """One line of the results table: a name and the LatteConfig fields it changes."""

    name: str
    changes: dict
    kind: str = "latte"  # 'exact', 'uniform' or 'latte'


#: The paper's grid (spec section 9, with the paper's per-layer score), the control, and
#: what the spec leaves open. ``latte+greedy`` is the default recipe (see README).
ROWS = [
    Row("exact", {}, "exact"),
    Row("uniform", {}, "uniform"),
    Row("qtvit", {"variant": "qtvit", "selection": "score"}),
    Row("jpn_only", {"variant": "jpn_only", "selection": "score"}),
    Row("tte_only", {"variant": "tte_only", "selection": "score"}),
    Row("latte", {"variant": "latte", "selection": "score"}),
    Row("latte+sequential", {"variant": "latte", "selection": "score", "sequential": True}),
    Row("latte-no-sigma", {"variant": "latte", "selection": "score", "fit_sigma": False}),
    Row("latte+greedy", {"variant": "latte", "selection": "greedy"}),
    Row("latte+greedy@83%", {"variant": "latte", "selection": "greedy", "ratio": 0.83, "num_linear": None}),
]
#: The row whose calibrated checkpoint the main job saves and reports at the top level.
DEFAULT_ROW = "latte+greedy"


@torch.no_grad()
def encoder_latency(model, batch, reps: int = 5, module: str = "encoder") -> float:
    """Best-of-``reps`` seconds spent inside ``model.<module>`` for one forward on ``batch``."""
    model = unwrap(model)
    enc = getattr(model, module)
    forward = detector_forward(model)
    spent = []

    def pre(_m, _a):
        spent.append(-time.perf_counter())

    def post(_m, _a, _o):
        spent[-1] += time.perf_counter()

    h1, h2 = enc.register_forward_pre_hook(pre), enc.register_forward_hook(post)
    was_training = model.training
    model.eval()  # train-mode BatchNorm would update its running statistics
    try:
        forward(batch)  # warm-up
        spent.clear()
        for _ in range(reps):
            forward(batch)
    finally:
        h1.remove(), h2.remove()
        model.train(was_training)
    return min(spent)


def run_rows(runner, batches: list, base: LatteConfig, rows: Optional[list] = None, timing_reps: int = 20,
             on_calibrated: Optional[Callable[[str, dict], None]] = None) -> dict:
    """Calibrates and evaluates every row.

    Args:
        runner: an mmengine Runner whose model already holds LATTE cores.
        batches: calibration batches from the train split.
        base: the settings every row starts from.
        rows: defaults to :data:`ROWS`.
        on_calibrated: called as ``(row name, report)`` right after a row is calibrated
            (e.g. to save that row's checkpoint).

    Returns:
        ``{"rows": {name: metrics, linear, encoder_latency_ratio, attention_gflops, retained},
        "reports": {name: calibration report}}``.
    """
    model = unwrap(runner.model)
    model.eval()
    rows = rows or ROWS
    results, reports = {}, {}
    timing_batch = batches[0]
    for row in rows:
        t0 = time.time()
        cfg = dataclasses.replace(copy.deepcopy(base), **row.changes)
        layers = find_latte_layers(model)
        if row.kind == "latte":
            rep = calibrate_detector(model, batches, cfg)
            reports[row.name] = rep
            if on_calibrated is not None:
                on_calibrated(row.name, rep)
            linear = rep["linearized"]
        else:
            linear = list(layers) if row.kind == "uniform" else []
        mode = "uniform" if row.kind == "uniform" else cfg.mode
        set_modes(layers, [], "exact")
        t_exact = encoder_latency(model, timing_batch, timing_reps)
        set_modes(layers, linear, mode)
        t_row = encoder_latency(model, timing_batch, timing_reps)
        metrics = evaluate_bbox(runner, linear, mode)
        results[row.name] = {
            **metrics,
            "linear": f"{len(linear)}/{len(layers)}",
            "linearized": list(linear),
            "encoder_latency_ratio": t_exact / t_row,
            "seconds": time.time() - t0,
        }
        print_log(f"[latte] row {row.name}: bbox_mAP={metrics['bbox_mAP']:.4f} "
                  f"({time.time() - t0:.0f} s)", logger="current")
    # GFLOPs per row from the token counts the calibration measured (self-attention: M = N).
    shapes = next(iter(reports.values()))["tokens"] if reports else {}
    pairs = {n: (t, t) for n, t in shapes.items()}
    layers = find_latte_layers(model)
    exact_map = results.get("exact", {}).get("bbox_mAP", float("nan"))
    for row in rows:
        r = results[row.name]
        mode = "uniform" if row.kind == "uniform" else "linear"
        r["attention_gflops"] = attention_gflops(pairs, layers, r["linearized"], mode) if shapes else float("nan")
        r["retained"] = r["bbox_mAP"] / exact_map if exact_map and exact_map > 0 else float("nan")
    return {"rows": results, "reports": reports}
