"""Output corrections of a linear layer and their nested cross-fitting (``docs/method.md#output-correction``,
``docs/method.md#cross-fitting``).

A correction maps the linear layer's output ``o`` to ``[o, 1] W`` (``W`` ``(C+1, C)``): none,
the paper's per-channel sigma, or a ridge refit of the whole output; or, in self-attention, to
``[o, 1, v_own] W`` (``W`` ``(2C+1, C)``, kind ``diag``): the refit plus a linear term in each
query's own value. Everything is closed form
from per-fold sufficient statistics (:class:`FoldSums`): each rule (:func:`fit_rule`) chooses among
its candidates by cross-fitting, and for every fold holds the choice and the weights made without
it (:class:`FittedCorrection`), which is what lets the judge never score an image with a
correction fitted on it. :class:`CorrectionTable` is every rule's corrections, read-only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .. import ops
from ..nn.params import LatteParams
from .config import CORRECTIONS, CROSS_FIT_FOLDS, REFIT_FALLBACK, REFIT_REGS
from .closed_form import correction_mse, correction_weights, sums_without, total_sums
from .context import AllReduce, no_reduce
from .record import RecordedItem, item_position, stack_by_shape, sum_count

__all__ = ["LayerRecords", "FitOptions", "FitResult", "FittedCorrection", "CorrectionTable", "FoldSums",
           "linear_outputs", "reconstruction_error", "reset_correction", "apply_correction", "set_correction",
           "correction_weights", "correction_candidates", "rule_candidates", "partition", "assign_folds",
           "cv_choice", "fit_rule", "fit_correction"]


@dataclass(frozen=True)
class LayerRecords:
    """One layer's recorded items by role: fitted on, choosing the knobs, only reporting."""

    fit: Sequence[RecordedItem]
    choose: Sequence[RecordedItem] = ()
    report: Sequence[RecordedItem] = ()


@dataclass(frozen=True)
class FitOptions:
    """How one layer is fitted (``LatteConfig``'s fields of the same meaning).

    Attributes:
        steps: maximum L-BFGS iterations. lr: L-BFGS step scale.
        correction: one of :data:`~latte_plugin.calibration.config.CORRECTIONS` (``auto``: chosen
            per layer by cross-fitting).
        per_head: one ``(m, log_rho)`` per head; else one pair shared by the layer (the paper).
        refit_regs: ridge strengths compared by cross-fitting (one value: used as is).
        fold_of: ``{global position: fold}`` (:func:`assign_folds`) of the fit and choice images:
            each rule chooses among its candidates by cross-fitting over these folds. Without it,
            items are dealt round-robin.
        rules: further correction rules to fit beside ``correction`` (``FitResult.rules``).
        all_reduce: sums a tensor across ranks in place.
        kernel, piecewise_*: the kernel choice (``kernel_choice.choose_kernel``; LatteConfig's fields).
    """

    steps: int = 20
    lr: float = 1.0
    correction: str = "auto"
    per_head: bool = False
    refit_regs: tuple = REFIT_REGS
    fold_of: Optional[Mapping[int, int]] = None
    rules: tuple = ()
    all_reduce: AllReduce = no_reduce
    kernel: str = "latte"
    piecewise_top: Optional[int] = None
    piecewise_block: int = 64
    piecewise_rest: str = "latte"
    piecewise_order: str = "similarity"

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown output correction {self.correction!r}; choose one of {', '.join(CORRECTIONS)}")
        object.__setattr__(self, "refit_regs", tuple(self.refit_regs))
        object.__setattr__(self, "rules", tuple(self.rules or ()))


@dataclass
class FitResult:
    """Outcome of :func:`fit_layer`.

    Attributes:
        initial_mse, final_mse: fit-set MSE at the start (alpha from the weighted mean) and at the end.
        alpha_init: the starting anchor.
        heldout_mse: MSE of the final layer (scalars and correction) on the *report* items:
            images nothing was fitted on and nothing was chosen by. ``None`` without them.
        steps: the L-BFGS iterations kept (chosen on the choice items when there are any).
        refit_reg: the chosen ridge strength of the output refit (``None`` unless ``correction='refit'``).
        choice: errors on the *choice* items that chose the knobs, ``{"steps": {n: mse},
            "refit_reg": {reg: mse}}`` (not held-out figures: they picked the winner).
        heldout: each correction's MSE on the report items (fitted without them):
            ``{"none": mse, "sigma": mse, "refit": mse}``; with ``correction='auto'``, every
            candidate's (``refit@<strength>`` each).
        correction: the correction applied (with ``auto``: the chosen candidate, e.g. ``refit@0.01``).
        kind: its kind (``none``, ``sigma`` or ``refit``); weights: its ``(C+1, C)`` weights.
        rules: ``{rule: FittedCorrection}`` of every rule fitted (``correction``'s and ``rules``),
            each with its per-fold weights for the cross-fitted judge.
        kernel: the kernel choice (``KernelChoice.entry()``), ``None`` with ``kernel='latte'``.
    """

    initial_mse: float
    final_mse: float
    alpha_init: float
    heldout_mse: Optional[float] = None
    steps: Optional[int] = None
    refit_reg: Optional[float] = None
    choice: dict = field(default_factory=dict)
    heldout: dict = field(default_factory=dict)
    correction: str = "none"
    kind: str = "none"
    weights: Optional[Tensor] = None
    rules: dict = field(default_factory=dict)
    kernel: Optional[dict] = None


@dataclass
class FittedCorrection:
    """One correction rule fitted on a layer: on every image, and once per fold without it.

    Attributes:
        name: the candidate the rule chose on all folds (``sigma``, ``none``, ``refit@<strength>``).
        kind: its kind (``none``, ``sigma`` or ``refit``); weights: its ``(C+1, C)`` weights,
            fitted on every fold.
        folds: per fold, ``(kind, weights)`` *chosen and fitted* without that fold (the rule's
            choice among its candidates is nested inside the folds, so the fold left out never
            sees a choice made with it in view).
        cv: ``{candidate: cross-fitted MSE}`` over all folds (what chose ``name``; empty when the
            rule has one candidate or there is only one fold).
        fold_names: the candidate chosen for each fold. origin: ``""`` for a fit on the exact
            model's inputs, ``"compensation"`` for a compensated refit. Two corrections of a
            layer with the same name, fold names and origin hold the same weights (the judge
            uses this to measure a set once).
    """

    name: str
    kind: str
    weights: Tensor
    folds: list
    cv: dict = field(default_factory=dict)
    fold_names: tuple = ()
    origin: str = ""

    def signature(self) -> tuple:
        return (self.name, self.fold_names, self.origin)


@dataclass(frozen=True)
class CorrectionTable:
    """Every rule's fitted corrections, ``{rule: {layer: FittedCorrection}}``, read-only.

    A linear share adds the compensated corrections by :meth:`with_rule`, which returns a new
    table: no share can change what another reads.
    """

    by_rule: Mapping[str, Mapping[str, FittedCorrection]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        frozen = {r: MappingProxyType(dict(c)) for r, c in self.by_rule.items()}
        object.__setattr__(self, "by_rule", MappingProxyType(frozen))

    def __getitem__(self, rule: str) -> Mapping[str, FittedCorrection]:
        return self.by_rule[rule]

    def __contains__(self, rule: str) -> bool:
        return rule in self.by_rule

    def with_rule(self, rule: str, corrections: Mapping[str, FittedCorrection]) -> "CorrectionTable":
        """A new table with ``rule``'s corrections set to ``corrections``."""
        return CorrectionTable({**self.by_rule, rule: corrections})


def linear_outputs(layer: LatteParams, it: RecordedItem, m: Tensor, log_rho: Tensor) -> Tensor:
    """The layer's non-exact output on a recorded item (``(H, n, d_v)`` or stacked ``(G, H, n, d_v)``),
    before the output correction: LATTE at ``(m, log_rho)``, or the layer's piecewise kernel (its
    own scalars) on the item's pooled queries."""
    if layer.kernel == "piecewise" and it.q_pool is not None:
        one = it.q.dim() == 3
        q, k, v, pool = (x.unsqueeze(0) if one else x for x in (it.q, it.k, it.v, it.q_pool))
        o = layer.piecewise(q, k, v, q_pool=pool)
        return o.squeeze(0) if one else o
    fq, fk = layer.features(it.q, it.k, m=m, log_rho=log_rho)
    if it.mask is not None:  # general (causal) mask: the quadratic masked form
        return ops.naive_linear_attention(fq, fk, it.v, attn_mask=it.mask)
    return ops.linear_attention(fq, fk, it.v)  # (H, n, d_v)


def reconstruction_error(
    layer: LatteParams, items: list[RecordedItem], all_reduce: AllReduce = no_reduce, use_sigma: bool = True
) -> float:
    """Mean squared error between the layer's current linear output and the recorded softmax output."""
    vals = []
    with torch.no_grad():
        for it in items:
            o = linear_outputs(layer, it, layer.m, layer.log_rho)
            if use_sigma:  # sigma and, if fitted, the output refit (and the diagonal term)
                o = layer.correct(o, it.v_own)
            vals.append((((o - it.target) ** 2).sum(), float(o.numel())))
    acc = sum_count(vals, all_reduce)
    return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")


def _rows(o: Tensor) -> Tensor:
    """``(G, H, n, d_v)`` or ``(H, n, d_v)`` -> ``(rows, H * d_v)``: heads concatenated per token."""
    if o.dim() == 3:
        o = o.unsqueeze(0)
    g, h, n, dv = o.shape
    return o.permute(0, 2, 1, 3).reshape(g * n, h * dv)


def _normal_sums(layer: LatteParams, stacked: list[RecordedItem], all_reduce: AllReduce,
                 own: bool = False) -> dict[str, Tensor]:
    """Sufficient statistics of the output corrections, summed across ranks (float64): ``xtx``
    ``(F, F)`` and ``xty`` ``(F, C)`` of the features ``[o, 1]`` (``F = C+1``), with ``own`` of
    ``[o, 1, v_own]`` (``F = 2C+1``; ``v_own`` zero where an item has none: its diagonal weights
    then shrink to zero), ``yty`` and ``rows``. The first ``C+1`` features are what ``none``,
    ``sigma`` and ``refit`` see (``closed_form.leading``)."""
    c = layer.embed_dim
    f = 2 * c + 1 if own else c + 1
    xtx = torch.zeros(f, f, dtype=torch.float64)
    xty = torch.zeros(f, c, dtype=torch.float64)
    rest = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for it in stacked:
            x = _rows(linear_outputs(layer, it, layer.m.double(), layer.log_rho.double()).double())
            y = _rows(it.target.double())
            parts = [x, torch.ones(x.shape[0], 1, dtype=x.dtype)]
            if own:
                parts.append(torch.zeros_like(x) if it.v_own is None else _rows(it.v_own.double()))
            x1 = torch.cat(parts, dim=1)
            xtx += x1.t() @ x1
            xty += x1.t() @ y
            rest[0] += (y * y).sum()
            rest[1] += x.shape[0]
    flat = all_reduce(torch.cat([xtx.reshape(-1), xty.reshape(-1), rest]))
    n1, n2 = f * f, f * c
    return {"xtx": flat[:n1].view(f, f), "xty": flat[n1:n1 + n2].view(f, c), "yty": flat[-2], "rows": flat[-1]}


def reset_correction(layer: LatteParams) -> None:
    layer.sigma.fill_(1.0)
    layer.refit_on.fill_(False)
    layer.refit_weight.copy_(torch.eye(layer.embed_dim))
    layer.refit_bias.zero_()
    layer.diag_on.fill_(False)
    layer.diag_weight.zero_()


def apply_correction(layer: LatteParams, kind: str, w: Tensor) -> None:
    """Writes a correction into the layer's buffers (sigma for ``sigma``, the refit for ``refit``,
    the refit and the diagonal term for ``diag``)."""
    c = layer.embed_dim
    if kind == "sigma":
        layer.sigma.copy_(w[:c].diagonal().float())
    elif kind in ("refit", "diag"):
        layer.refit_weight.copy_(w[:c].t().float())
        layer.refit_bias.copy_(w[c].float())
        layer.refit_on.fill_(True)
        if kind == "diag":
            layer.diag_weight.copy_(w[c + 1:].t().float())
            layer.diag_on.fill_(True)


def set_correction(layer: LatteParams, kind: str, w: Tensor) -> None:
    """Replaces whatever correction the layer holds by ``kind`` with weights ``w``."""
    reset_correction(layer)
    apply_correction(layer, kind, w)


def correction_candidates(refit_regs: tuple) -> dict[str, tuple[str, Optional[float]]]:
    """``correction='auto'``'s candidates, the paper's sigma first (it wins ties)."""
    return {"sigma": ("sigma", None), "none": ("none", None),
            **{f"refit@{float(r):g}": ("refit", float(r)) for r in refit_regs}}


def partition(items: list[RecordedItem], folds: int, fold_of: Optional[Mapping[int, int]] = None) -> list[list]:
    """Items dealt to ``folds`` folds: by ``fold_of[position]`` when given (every layer then
    shares the same folds), else round-robin in the order given."""
    if fold_of is None:
        return [items[i::folds] for i in range(min(folds, len(items)))]
    parts: list[list] = [[] for _ in range(folds)]
    for it in items:
        parts[fold_of[item_position(it)]].append(it)
    return parts


def assign_folds(positions: Iterable[int], folds: int = CROSS_FIT_FOLDS) -> dict[int, int]:
    """``{global position: fold}``: the sorted positions dealt round-robin, so the same images
    share a fold in every layer and on every rank."""
    return {p: i % folds for i, p in enumerate(sorted(set(int(p) for p in positions)))}


def rule_candidates(rule: str, refit_regs: tuple) -> dict[str, tuple[str, Optional[float]]]:
    """A correction rule's candidates ``{name: (kind, strength)}``: one for ``none`` and ``sigma``,
    each strength for ``refit``, all of them for ``auto`` (the paper's sigma first: it wins ties)."""
    if rule in ("none", "sigma"):
        return {rule: (rule, None)}
    if rule in ("refit", "diag"):
        return {f"{rule}@{float(r):g}": (rule, float(r)) for r in refit_regs}
    return correction_candidates(refit_regs)


def _fallback(cands: dict) -> str:
    """The candidate a rule takes with fewer than two folds to compare on."""
    if "sigma" in cands:
        return "sigma"
    name = f"{next(iter(cands.values()))[0]}@{REFIT_FALLBACK:g}"
    return name if name in cands else next(iter(cands))


class FoldSums:
    """Each fold's correction sufficient statistics, and the weights fitted without some folds,
    computed once however many rules and nested choices ask for them."""

    def __init__(self, parts: list[dict[str, Tensor]]) -> None:
        self.parts = parts
        self.total = total_sums(parts)
        self._bases: dict[frozenset, dict[str, Tensor]] = {frozenset(): self.total}
        self._weights: dict[tuple, Tensor] = {}

    def weights(self, left_out: frozenset, fold: Optional[int], kind: str, reg: Optional[float]) -> Tensor:
        """The correction ``(kind, reg)`` fitted on the folds but ``left_out`` (summed), less ``fold``."""
        key = (left_out, fold, kind, reg)
        if key not in self._weights:
            if left_out not in self._bases:
                self._bases[left_out] = total_sums([p for g, p in enumerate(self.parts) if g not in left_out])
            base = self._bases[left_out]
            self._weights[key] = correction_weights(kind, base if fold is None else sums_without(base, self.parts[fold]), reg)
        return self._weights[key]


def cv_choice(cands: dict[str, tuple[str, Optional[float]]], sums: FoldSums,
              left_out: frozenset = frozenset()) -> tuple[str, dict[str, float]]:
    """The candidate of lowest k-fold error over the folds not ``left_out`` (each fitted on the
    others of them, scored on it): ``(name, {name: cross-fitted MSE})``."""
    used = [f for f, p in enumerate(sums.parts) if f not in left_out and float(p["rows"]) > 0]
    if len(cands) == 1:
        return next(iter(cands)), {}
    if len(used) < 2:
        return _fallback(cands), {}
    rows = sum(float(sums.parts[f]["rows"]) for f in used)
    errs: dict[str, float] = {}
    for name, (kind, reg) in cands.items():
        sse = sum(correction_mse(sums.weights(left_out, f, kind, reg), sums.parts[f]) * float(sums.parts[f]["rows"])
                  for f in used)
        err = sse / rows
        errs[name] = err if math.isfinite(err) else math.inf
    order = list(cands)
    return min(order, key=lambda n: (errs[n], order.index(n))), errs


def fit_rule(rule: str, sums: FoldSums, refit_regs: tuple) -> FittedCorrection:
    """Fits a correction rule from each fold's sums: its choice and weights on all folds, and,
    for each fold, the choice made by cross-fitting over the *other* folds and the weights
    fitted on them (nested: closed form, every fit computed once in ``sums``)."""
    cands = rule_candidates(rule, refit_regs)
    name, cv = cv_choice(cands, sums)
    folds, names = [], []
    for f in range(len(sums.parts)):
        inner, _ = cv_choice(cands, sums, frozenset({f}))
        kind, reg = cands[inner]
        folds.append((kind, sums.weights(frozenset(), f, kind, reg)))
        names.append(inner)
    kind, reg = cands[name]
    return FittedCorrection(name, kind, sums.weights(frozenset(), None, kind, reg), folds, cv, tuple(names))


def fit_correction(layer: LatteParams, records: LayerRecords, opts: FitOptions) -> FitResult:
    """Fits only the output correction of a layer whose kernel scalars are set, in place
    (as ``latte_plugin.calibration.fit.fit_layer`` does after the kernel scalars).

    Every rule in ``opts.rules`` and ``opts.correction`` is fitted by :func:`fit_rule` on the fit
    and choice items dealt to the folds; the layer takes ``correction``'s. Also what error
    compensation refits: the items' targets may then be the *exact* model's outputs while
    their q, k, v come from the hybrid model.
    """
    correction, refit_regs, fold_of, all_reduce = opts.correction, opts.refit_regs, opts.fold_of, opts.all_reduce
    items, report = list(records.fit), list(records.report)
    reset_correction(layer)
    folds = max(fold_of.values()) + 1 if fold_of else CROSS_FIT_FOLDS
    parts = partition(items + list(records.choose), folds, fold_of)
    own = "diag" in (correction, *opts.rules)  # only the diagonal term needs the own values' sums
    sums = FoldSums([_normal_sums(layer, stack_by_shape(p), all_reduce, own) for p in parts])
    fitted = {r: fit_rule(r, sums, refit_regs) for r in dict.fromkeys([correction, *opts.rules])}
    mine = fitted[correction]
    apply_correction(layer, mine.kind, mine.weights)
    layer.calibrated.fill_(True)
    cands = rule_candidates(correction, refit_regs) if correction in ("auto", "refit", "diag") else {
        c: (c, REFIT_FALLBACK if c == "refit" else None) for c in ("none", "sigma", "refit")}
    has_report = float(all_reduce(torch.tensor([float(len(report))], dtype=torch.float64))[0]) > 0
    heldout = _report_errors(layer, sums.total, report, all_reduce, cands, own) if has_report else {}
    final = reconstruction_error(layer, items, all_reduce)
    return FitResult(initial_mse=final, final_mse=final, alpha_init=float(layer.alpha),
                     heldout_mse=heldout.get(mine.name, heldout.get(mine.kind)),
                     refit_reg=cands[mine.name][1] if mine.kind in ("refit", "diag") else None, choice={"correction": mine.cv},
                     heldout=heldout, correction=mine.name, kind=mine.kind, weights=mine.weights, rules=fitted)


def _report_errors(layer: LatteParams, sums: dict[str, Tensor], report: list[RecordedItem],
                   all_reduce: AllReduce, cands: dict[str, tuple[str, Optional[float]]], own: bool) -> dict[str, float]:
    """Each candidate correction's MSE on the report items (fitted on ``sums``, never on them)."""
    report_sums = _normal_sums(layer, stack_by_shape(report), all_reduce, own)
    return {name: correction_mse(correction_weights(kind, sums, reg), report_sums) for name, (kind, reg) in cands.items()}
