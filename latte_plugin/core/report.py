"""The calibration report (``docs/method.md#report``): what :func:`~latte_plugin.core.flow.calibrate_model`
returns and the adapters write as ``latte_report.json``."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .calibration import AllReduce, FitResult
from .flops import attention_gflops
from .judge import CalibrationSplit, image_counts
from .layer import LatteParams
from .settings import LatteConfig

__all__ = ["build_report", "fit_entry"]


def fit_entry(res: FitResult) -> dict:
    """A layer's fit, as the report holds it."""
    return {"mse_initial": res.initial_mse, "mse_final": res.final_mse, "alpha_init": res.alpha_init,
            "heldout_mse": res.heldout_mse, "steps": res.steps, "refit_reg": res.refit_reg,
            "heldout": res.heldout, "choice": res.choice, "correction": res.correction}


def build_report(layers: dict[str, LatteParams], cfg: LatteConfig, split: CalibrationSplit, reduce: AllReduce, k: int,
                 chosen: list[str], sens: dict, fits: dict, trace: list, tokens: Tensor,
                 heldout_distortion: Optional[float] = None, signal: Optional[dict] = None) -> dict:
    """The report of one calibration; ``tokens``: ``(token rows, images)`` per layer, summed over
    the scored images (each layer's mean token count gives its attention FLOPs); ``signal``: each
    candidate's :func:`~latte_plugin.core.signal.attention_signal` (how much the exact model's
    outputs move with that layer's attention replaced by its mean: ~0 for a branch the network
    ignores, where going linear proves nothing)."""
    names = list(layers)
    shapes = {n: (int(round(float(tokens[i, 0] / tokens[i, 1]))),) * 2 for i, n in enumerate(names)}
    return {
        "variant": cfg.variant,
        "candidates": names,
        "sensitivity": sens,
        "signal": signal or {},
        "linearized": chosen,
        "params": {n: layers[n].scalars() for n in names},
        "sigma_mean": {n: float(layers[n].sigma.mean()) for n in names},
        "fit": fits,
        "selection": {"method": cfg.selection, "k": k, "trace": trace, "heldout_distortion": heldout_distortion,
                      "images": dict(split.counts), **image_counts(split, reduce)},
        "tokens": {n: shapes[n][0] for n in names},
        "attention_gflops": {"exact": attention_gflops(shapes, layers, []),
                             "linearized": attention_gflops(shapes, layers, chosen)},
        "config": cfg.to_dict(),
    }
