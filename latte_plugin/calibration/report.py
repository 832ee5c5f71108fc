"""The calibration report (``docs/method.md#report``): what
:func:`~latte_plugin.calibration.flow.calibrate_model` returns and the adapters write as
``latte_report.json``, built from one typed :class:`ShareResult`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import Tensor

from ..ops.flops import attention_gflops
from .context import CalibrationRun
from .corrections import FitResult
from .judge import image_counts

__all__ = ["ShareResult", "build_report", "fit_entry"]


def fit_entry(res: FitResult) -> dict:
    """A layer's fit, as the report holds it."""
    return {"mse_initial": res.initial_mse, "mse_final": res.final_mse, "alpha_init": res.alpha_init,
            "heldout_mse": res.heldout_mse, "steps": res.steps, "refit_reg": res.refit_reg,
            "heldout": res.heldout, "choice": res.choice, "correction": res.correction,
            **({"kernel": res.kernel} if res.kernel else {})}


@dataclass(frozen=True)
class ShareResult:
    """What one linear share of a calibration chose, for its report.

    Attributes:
        k: the number of linear layers asked for (or ``target``'s count).
        linear: the chosen layers, in model order.
        sensitivity: ``{layer: the paper's score}`` over every scored image.
        fits: ``{layer: report entry}`` (:func:`fit_entry`, plus ``compensated`` and ``applied``).
        trace: the chosen search's trace.
        tokens: ``(token rows, images)`` per layer ``(L, 2)``, summed over the scored images (each
            layer's mean token count gives its attention FLOPs).
        heldout_distortion: the chosen configuration's raw-output MSE on held-out (or cross-fitted) images.
        signal: each candidate's :func:`~latte_plugin.calibration.signal.attention_signal` (how much
            the exact model's outputs move with that layer's attention replaced by its mean: ~0 for
            a branch the network ignores, where going linear proves nothing).
    """

    k: int
    linear: list[str]
    sensitivity: Mapping[str, float]
    fits: Mapping[str, dict]
    trace: list
    tokens: Tensor
    heldout_distortion: Optional[float] = None
    signal: Mapping[str, float] = field(default_factory=dict)


def build_report(run: CalibrationRun, share: ShareResult) -> dict:
    """The report of one share of a calibration (``run.cfg`` is that share's settings)."""
    layers, cfg, split = run.layers, run.cfg, run.split
    names = list(layers)
    shapes = {n: (int(round(float(share.tokens[i, 0] / share.tokens[i, 1]))),) * 2 for i, n in enumerate(names)}
    return {
        "variant": cfg.variant,
        "candidates": names,
        "sensitivity": dict(share.sensitivity),
        "signal": dict(share.signal or {}),
        "linearized": list(share.linear),
        "params": {n: layers[n].scalars() for n in names},
        "sigma_mean": {n: float(layers[n].sigma.mean()) for n in names},
        "fit": {n: dict(f) for n, f in share.fits.items()},
        "selection": {"method": cfg.selection, "k": share.k, "trace": share.trace,
                      "heldout_distortion": share.heldout_distortion,
                      "images": dict(split.counts), **image_counts(split, run.reduce)},
        "tokens": {n: shapes[n][0] for n in names},
        "attention_gflops": {"exact": attention_gflops(shapes, layers, []),
                             "linearized": attention_gflops(shapes, layers, share.linear),
                             # each layer in the hybrid: exact, or linear with its kernel (LATTE or piecewise)
                             "per_layer": {n: attention_gflops({n: shapes[n]}, layers, [n] if n in share.linear else [])
                                           for n in names}},
        "config": cfg.to_dict(),
    }
