"""Fitting one layer's kernel scalars by local reconstruction (``docs/method.md#calibration``):
the anchor ``m`` (so alpha) and ``log_rho`` from a coarse grid, refined by full-batch L-BFGS,
then the output correction (:func:`~latte_plugin.calibration.corrections.fit_correction`).

Statistics that cross ranks go through an ``all_reduce`` callable that sums a tensor (float64)
in place; the flow gives every rank the same items (``record.share_items``), so every rank
fits the same scalars.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..nn.params import LatteParams
from .config import STEP_CHECKPOINTS
from .context import AllReduce, no_reduce
from .corrections import (FitOptions, FitResult, LayerRecords, fit_correction, linear_outputs, reconstruction_error,
                          reset_correction)
from .kernel_choice import choose_kernel
from .record import RecordedItem, stack_by_shape, sum_count

__all__ = ["softmax_weighted_mean_score", "grid_start", "lbfgs_refine", "fit_records", "fit_layer"]


def softmax_weighted_mean_score(items: list[RecordedItem], all_reduce: AllReduce = no_reduce) -> float:
    """The spec's starting anchor: the softmax-weighted mean of ``x_ij = <q_i, k_j> / sqrt(d)``."""
    vals = []
    for it in items:
        x = it.q @ it.k.transpose(-1, -2) / math.sqrt(it.q.shape[-1])
        if it.mask is not None:
            p = torch.softmax(x.masked_fill(it.mask, float("-inf")), dim=-1).nan_to_num(0.0)
            x = x.masked_fill(it.mask, 0.0)
        else:
            p = torch.softmax(x, dim=-1)
        vals.append(((p * x).sum(), float(x.shape[0] * x.shape[1])))
    acc = sum_count(vals, all_reduce)
    if acc[1] == 0:
        raise ValueError("cannot calibrate a layer with no recorded tokens (is the calibration set empty?)")
    return float(acc[0] / acc[1])


def _head_losses(layer: LatteParams, stacked: list[RecordedItem], m: Tensor, log_rho: Tensor, total: float) -> Tensor:
    """Squared error per head ``(H,)``, divided by the global element count."""
    loss = torch.zeros(layer.num_heads, dtype=torch.float64)
    for it in stacked:
        o = linear_outputs(layer, it, m, log_rho)  # (G, H, n, dv)
        loss = loss + ((o - it.target) ** 2).sum(dim=(0, 2, 3)).double() / total
    return loss


@dataclass
class _Stacked:
    """A rank's items stacked by shape (float64) and the global element count of their targets."""

    groups: list[RecordedItem]
    total: float

    @classmethod
    def of(cls, items: list[RecordedItem], all_reduce: AllReduce) -> "_Stacked":
        total = float(sum_count([(0.0, float(it.target.numel())) for it in items], all_reduce)[1])
        return cls(stack_by_shape(items), total)

    def head_losses(self, layer: LatteParams, m: Tensor, log_rho: Tensor, all_reduce: AllReduce) -> Tensor:
        """Global per-head MSE ``(H,)`` at ``(m, log_rho)`` (shared values broadcast over heads)."""
        h = layer.num_heads
        loss = _head_losses(layer, self.groups, m.expand(h), log_rho.expand(h), max(self.total, 1.0))
        return all_reduce(loss.detach().clone())


def _reset(layer: LatteParams, m0: float) -> None:
    reset_correction(layer)
    layer.kernel = "latte"  # the scalars are LATTE's; the kernel is chosen after them
    layer.m.fill_(m0)
    layer.log_rho.fill_(0.0)


def grid_start(layer: LatteParams, fit: _Stacked, m0: float, fit_m: bool, per_head: bool,
               all_reduce: AllReduce) -> tuple[Tensor, Tensor, Tensor]:
    """The best ``(loss, m, log_rho)`` of a coarse grid (per head or shared), robust to the layer's sharpness."""
    n_par = layer.num_heads if per_head else 1
    best = torch.full((n_par,), math.inf, dtype=torch.float64)
    best_m = torch.full((n_par,), m0, dtype=torch.float64)
    best_r = torch.zeros(n_par, dtype=torch.float64)
    with torch.no_grad():
        for mm in (sorted({m0, 0.3, 1.0, 2.0}) if fit_m else [m0]):
            for r0 in (0.0, 2.0, 4.0, 8.0):
                one = torch.tensor([mm], dtype=torch.float64)
                val = fit.head_losses(layer, one, torch.tensor([r0], dtype=torch.float64), all_reduce)
                val = val if per_head else val.sum().reshape(1)
                better = val < best
                best = torch.where(better, val, best)
                best_m = torch.where(better, one, best_m)
                best_r = torch.where(better, torch.full_like(best_r, r0), best_r)
    return best, best_m, best_r


def lbfgs_refine(layer: LatteParams, fit: _Stacked, start: tuple[Tensor, Tensor, Tensor], fit_m: bool,
                 opts: FitOptions, choose: Optional[_Stacked] = None) -> tuple[Tensor, Tensor, int, dict]:
    """Full-batch L-BFGS (strong Wolfe) from the grid start on the fit items.

    With ``choose`` items, the iterate is scored on them at each of :data:`STEP_CHECKPOINTS`
    (0 = the grid start) and the best is kept; else the last. An iterate that is non-finite or
    worse than the grid start on the fit items is replaced by the start.

    Returns:
        ``(m, log_rho, iterations kept, {iterations: MSE on the choice items})``.
    """
    steps, lr, per_head, all_reduce = opts.steps, opts.lr, opts.per_head, opts.all_reduce
    best, best_m, best_r = start
    m = best_m.clone().requires_grad_(fit_m)
    log_rho = best_r.clone().requires_grad_(True)
    params = [p for p in (m, log_rho) if p.requires_grad]
    h = layer.num_heads

    def score(mm: Tensor, rr: Tensor) -> float:
        return float(choose.head_losses(layer, mm, rr, all_reduce).sum())

    def sanitized() -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            m_fit, r_fit = m.detach().abs().clone(), log_rho.detach().clamp(-20.0, 20.0)  # gauge cannot overflow
            val = fit.head_losses(layer, m_fit, r_fit, all_reduce)
            val = val if per_head else val.sum().reshape(1)
            bad = ~torch.isfinite(val) | ~torch.isfinite(m_fit) | (val > best)
            return torch.where(bad, best_m, m_fit), torch.where(bad, best_r, r_fit)

    def closure() -> Tensor:
        opt.zero_grad()
        with torch.enable_grad():
            loss = _head_losses(layer, fit.groups, m.expand(h), log_rho.expand(h), fit.total).sum()
            grads = torch.autograd.grad(loss, params)
        g = all_reduce(torch.stack([x.detach() for x in grads]))
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        return all_reduce(loss.detach().reshape(1).clone())[0]

    chosen = (best_m.clone(), best_r.clone(), 0)
    trace = {0: score(best_m, best_r)} if choose is not None else {}
    if steps <= 0:
        return (*chosen, trace)
    opt = torch.optim.LBFGS(params, lr=lr, max_iter=steps, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-14)
    done = 0
    for c in (sorted({c for c in STEP_CHECKPOINTS if c < steps} | {steps}) if choose is not None else [steps]):
        opt.param_groups[0]["max_iter"], opt.param_groups[0]["max_eval"] = c - done, (c - done) * 5 // 4
        opt.step(closure)
        done = c
        m_c, r_c = sanitized()
        if choose is None:
            chosen = (m_c, r_c, c)
            continue
        trace[c] = e = score(m_c, r_c)
        if math.isfinite(e) and e < trace[chosen[2]]:
            chosen = (m_c, r_c, c)
    return (*chosen, trace)


def fit_layer(layer: LatteParams, items: Sequence[RecordedItem], choose: Optional[Sequence[RecordedItem]] = None,
              report: Optional[Sequence[RecordedItem]] = None, **options) -> FitResult:
    """:func:`fit_records` on ``items`` (fitted on), ``choose`` and ``report`` items, with
    ``options`` the :class:`~latte_plugin.calibration.corrections.FitOptions` fields by name
    (``steps=20, correction='auto', ...``)."""
    return fit_records(layer, LayerRecords(list(items), list(choose or []), list(report or [])), FitOptions(**options))


def fit_records(layer: LatteParams, records: LayerRecords, opts: FitOptions) -> FitResult:
    """Fits one layer's scalars by local reconstruction (``docs/method.md#calibration``), in place.

    ``m`` (so alpha) starts at the softmax-weighted mean score; :func:`grid_start` and
    :func:`lbfgs_refine` minimise the MSE against the recorded softmax outputs (``jpn_only``
    keeps ``m = 1``; ``qtvit`` has no anchor); then the output correction (``fit_correction``).
    Three disjoint sets of images play three roles: ``records.fit`` are fitted on (kernel
    scalars and corrections), ``records.choose`` choose the L-BFGS step count (and join the
    corrections' folds), ``records.report`` only give held-out errors.

    Raises:
        ValueError: no recorded items.
    """
    all_reduce, items, choose = opts.all_reduce, list(records.fit), list(records.choose)
    n_fit, n_choose = (float(x) for x in all_reduce(torch.tensor([len(items), len(choose)], dtype=torch.float64)))
    if n_fit == 0:
        raise ValueError("empty calibration set: no image reached the layer; give at least one image")
    fit_m = layer.variant in ("latte", "tte_only")
    alpha0 = min(softmax_weighted_mean_score(items, all_reduce), 1.0 - 1e-4)
    m0 = math.sqrt(1.0 - alpha0) if fit_m else 1.0
    _reset(layer, m0)
    initial = reconstruction_error(layer, items, all_reduce, use_sigma=False)
    fit = _Stacked.of(items, all_reduce)
    chooser = _Stacked.of(choose, all_reduce) if n_choose > 0 else None
    start = grid_start(layer, fit, m0, fit_m, opts.per_head, all_reduce)
    m, log_rho, n_steps, step_trace = lbfgs_refine(layer, fit, start, fit_m, opts, chooser)
    layer.m.copy_(m.expand(layer.num_heads))
    layer.log_rho.copy_(log_rho.expand(layer.num_heads))
    kernel = None
    if opts.kernel != "latte":
        kernel = choose_kernel(layer, records, opts)
        # the chosen kernel's error before the output correction on the report images, if any
        kernel = {**kernel.entry(), **({"heldout_mse": reconstruction_error(layer, list(records.report), opts.all_reduce,
                                                                            use_sigma=False)}
                                       if records.report else {})}
    res = fit_correction(layer, records, opts)
    return replace(res, initial_mse=initial, alpha_init=alpha0, steps=n_steps,
                   choice={"steps": step_trace, **res.choice}, kernel=kernel)

