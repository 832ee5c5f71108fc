"""Closed forms of the output corrections (``docs/method.md#output-correction``): from summed
sufficient statistics of the features ``[o, 1, v_own]`` (``xtx`` ``(F, F)``, ``xty`` ``(F, C)``,
``yty``, ``rows``), each kind's weights and the error of any weights. Pure tensor functions; the
recording, folds and layers are :mod:`.corrections`'.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["leading", "add_sums", "total_sums", "sums_without", "correction_mse", "identity_weights",
           "sigma_from_sums", "ridge", "correction_weights"]


def leading(sums: dict[str, Tensor], features: int) -> dict[str, Tensor]:
    """The sums of the first ``features`` features only."""
    return {**sums, "xtx": sums["xtx"][:features, :features], "xty": sums["xty"][:features]}


def add_sums(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: a[k] + b[k] for k in a}


def correction_mse(w: Tensor, sums: dict[str, Tensor]) -> float:
    """MSE of ``[x, 1] w`` (or ``[x, 1, v_own] w``) against ``y`` from the sums:
    ``(tr(w'XtXw) - 2 tr(w'XtY) + YtY) / (rows C)``."""
    c = w.shape[1]
    sums = leading(sums, w.shape[0])
    sse = (w * (sums["xtx"] @ w)).sum() - 2 * (w * sums["xty"]).sum() + sums["yty"]
    return float(sse / (sums["rows"] * c)) if float(sums["rows"]) > 0 else float("nan")


def identity_weights(c: int, diag: Optional[Tensor] = None) -> Tensor:
    w = torch.zeros(c + 1, c, dtype=torch.float64)
    w[:c].diagonal().copy_(torch.ones(c, dtype=torch.float64) if diag is None else diag.double())
    return w


def sigma_from_sums(sums: dict[str, Tensor]) -> Tensor:
    c = sums["xty"].shape[1]
    num, den = sums["xty"][:c].diagonal(), sums["xtx"][:c, :c].diagonal()
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.ones_like(num))


def ridge(sums: dict[str, Tensor], reg: float, features: int) -> Tensor:
    """Ridge refit pulled towards the identity (no refit) on the first ``features`` features:
    ``(C+1, C)`` weights, or ``(2C+1, C)`` with the diagonal term (pulled towards zero).

    ``min ||X w - y||^2 + lam ||w - w_0||^2`` with ``lam = reg * mean(diag(XtX))`` over ``o``'s
    block, so ``reg`` is scale-free. The bias row is not penalised.
    """
    c = sums["xty"].shape[1]
    sums = leading(sums, features)
    lam = reg * float(sums["xtx"][:c, :c].diagonal().mean().clamp_min(1e-30))
    pen = torch.ones(features, dtype=torch.float64)
    pen[c] = 0.0
    a = sums["xtx"] + lam * torch.diag(pen)
    b = sums["xty"] + lam * torch.cat([identity_weights(c), torch.zeros(features - c - 1, c, dtype=torch.float64)])
    return torch.linalg.solve(a + 1e-12 * torch.eye(features, dtype=torch.float64), b)


def correction_weights(kind: str, fit_sums: dict[str, Tensor], reg: Optional[float] = None) -> Tensor:
    """``(C+1, C)`` weights of an output correction fitted on ``fit_sums`` only (row ``C``: bias),
    ``(2C+1, C)`` for ``diag`` (rows ``C+1..2C``: the diagonal term)."""
    c = fit_sums["xty"].shape[1]
    if kind == "none":
        return identity_weights(c)
    if kind == "sigma":
        return identity_weights(c, sigma_from_sums(fit_sums))
    return ridge(fit_sums, float(reg), 2 * c + 1 if kind == "diag" else c + 1)


def total_sums(sums: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    total = sums[0]
    for extra in sums[1:]:
        total = add_sums(total, extra)
    return total


def sums_without(total: dict[str, Tensor], part: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: total[k] - part[k] for k in total}
