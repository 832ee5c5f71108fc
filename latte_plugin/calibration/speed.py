"""Choosing per-layer modes for speed (``speedup=``, ``choose_for='speed'``; ``docs/method.md#speed``).

The steps, in call order: every candidate layer is fitted in every mode it can take
(:func:`fit_modes`: LATTE and the piecewise kernel at each exact block count, each with its own
output correction and cross-fitting folds); each (layer, mode) is judged alone on the search
images (:func:`single_distortions`); the additive Pareto front over the
:class:`~latte_plugin.calibration.cost.CostModel`'s savings gives the candidate assignments
(:func:`~latte_plugin.calibration.front.pareto_front`); a spread of them is judged end to end on
every fit and choice image, each image with corrections fitted without its fold
(:func:`judge_assignment`); :func:`~latte_plugin.calibration.front.choose_point` picks one.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..nn.install import layer_states, restore_layer_states
from ..nn.params import LatteParams
from .context import CalibrationRun, Measure
from .corrections import FitOptions, FittedCorrection, LayerRecords, fit_correction, set_correction
from .cost import LATTE, CostModel, mode_top
from .front import FrontPoint, SpeedupUnreachable, choose_point, pareto_front, thin_front
from .judge import Verdict, merged, search_measure
from .kernel_choice import choose_kernel
from .select import scores, select_by_score, summed_stats
from .config import num_linear_layers

__all__ = ["ModeFit", "KERNEL_BUFFERS", "fit_modes", "load_mode", "install_assignment", "assignment_corrections",
           "judge_assignment", "single_distortions", "speed_front", "check_reachable", "SpeedChoice"]

#: The buffers that hold a layer's kernel (the LATTE scalars and the output correction are apart).
KERNEL_BUFFERS = ("kernel_id", "piecewise_top", "piecewise_gamma", "piecewise_rest_id", "piecewise_block",
                  "piecewise_order_id")


@dataclass(frozen=True)
class ModeFit:
    """One layer fitted in one mode.

    Attributes:
        mode: ``latte`` or ``piecewise@<top>``. buffers: the layer's kernel buffers in that mode.
        correction: the user's correction rule fitted on that kernel's outputs (with its folds).
        kernel: the piecewise choice (``KernelChoice.entry()``), ``None`` for LATTE.
        mse: the fit images' reconstruction MSE in that mode, correction included.
    """

    mode: str
    buffers: Mapping[str, Tensor] = field(repr=False)
    correction: FittedCorrection = field(repr=False)
    kernel: Optional[dict] = None
    mse: float = float("nan")

    def entry(self) -> dict:
        return {"kernel": self.kernel or {"kernel": "latte"}, "correction": self.correction.name, "mse": self.mse}


@torch.no_grad()
def fit_modes(layer: LatteParams, records: LayerRecords, opts: FitOptions, modes: Sequence[str]) -> dict[str, ModeFit]:
    """Fits ``layer`` (its LATTE scalars already fitted) in each of ``modes``; the layer's state is
    restored afterwards. A piecewise mode whose kernel cannot run on the records is left out."""
    saved = layer_states({"l": layer})
    opts = replace(opts, rules=())
    out = {}
    try:
        for mode in modes:
            top, kernel = mode_top(mode), None
            if top is None:
                layer.kernel = "latte"
            else:
                choice = choose_kernel(layer, records, replace(opts, kernel="piecewise", piecewise_top=top))
                if choice.kernel != "piecewise":
                    continue
                kernel = choice.entry()
            res = fit_correction(layer, records, opts)
            out[mode] = ModeFit(mode, {b: getattr(layer, b).clone() for b in KERNEL_BUFFERS},
                                res.rules[opts.correction], kernel, res.final_mse)
    finally:
        restore_layer_states({"l": layer}, saved)
    return out


def load_mode(layer: LatteParams, fit: ModeFit) -> None:
    """Gives ``layer`` the kernel of ``fit`` (its LATTE scalars are shared by every mode)."""
    for name, value in fit.buffers.items():
        getattr(layer, name).copy_(value)


Menus = Mapping[str, Mapping[str, ModeFit]]  # {layer: {mode: ModeFit}}


def assignment_corrections(menus: Menus, assignment: Mapping[str, str]) -> dict[str, FittedCorrection]:
    """``{layer: FittedCorrection}`` of an assignment's linear layers."""
    return {n: menus[n][m].correction for n, m in assignment.items()}


def install_assignment(layers: Mapping[str, LatteParams], menus: Menus, assignment: Mapping[str, str]) -> dict:
    """Gives each assigned layer its mode's kernel and full correction (the others keep theirs and
    run exact); returns ``{layer: correction name}``."""
    applied = {}
    for n, m in assignment.items():
        load_mode(layers[n], menus[n][m])
        corr = menus[n][m].correction
        set_correction(layers[n], corr.kind, corr.weights)
        applied[n] = corr.name
    return applied


def judge_assignment(judges: Sequence, measure: Measure, layers: Mapping[str, LatteParams], menus: Menus,
                     assignment: Mapping[str, str]) -> Verdict:
    """``assignment`` judged by ``measure`` on the judges' images (each a
    :class:`~latte_plugin.calibration.judge.CrossFitJudge`), each image with the corrections fitted
    without its fold; the assigned layers keep their modes' kernels afterwards."""
    for n, m in assignment.items():
        load_mode(layers[n], menus[n][m])
    corr = assignment_corrections(menus, assignment)
    return merged([j(measure, corr, None)(list(assignment)) for j in judges], measure)


def single_distortions(run: CalibrationRun, halves: Sequence, menus: Menus) -> dict[str, dict[str, float]]:
    """``{layer: {mode: cross-fitted raw-output MSE with only that layer in that mode}}`` on the
    search images of every half (with the query slots matched by box under ``search='matched'`` or
    ``judge='matched'``: :func:`~.judge.search_measure`)."""
    mse = search_measure(run.cfg, run.forward)
    searchers = [h.searcher for h in halves]
    out = {}
    for n in run.progress(list(menus), len(menus), "judging layer modes"):
        out[n] = {m: judge_assignment(searchers, mse, run.layers, menus, {n: m}).loss for m in menus[n]}
    return out


def check_reachable(cost: CostModel, speedup: Optional[float]) -> None:
    """Refuses, before any fit, a ``speedup`` above every assignment's predicted speed-up."""
    best = cost.predicted_speedup(cost.fastest())
    if speedup is not None and float(speedup) > best + 1e-12:
        raise SpeedupUnreachable(f"speedup={float(speedup):g} is above what the front offers: the largest predicted "
                                 f"end-to-end speed-up at this input size is {best:.2f}x (every candidate in its "
                                 f"cheapest mode); ask for at most {best:.2f}")


@dataclass(frozen=True)
class SpeedChoice:
    """What the speed search chose: the point, every judged point, the measure and the singles."""

    chosen: FrontPoint
    judged: list
    measure: str
    singles: dict
    front_size: int
    marks: dict = field(default_factory=dict)

    def entry(self) -> dict:
        return {"chosen": self.chosen.entry(), "front": [p.entry() for p in self.judged], "measure": self.measure,
                "single_distortions": self.singles, "additive_front_points": self.front_size,
                "marks": {k: p.entry() for k, p in self.marks.items()}}


def _order(run: CalibrationRun, assignment: Mapping[str, str]) -> dict[str, str]:
    return {n: assignment[n] for n in run.layers if n in assignment}


def speed_front(run: CalibrationRun, halves: Sequence, menus: Menus, cost: CostModel) -> SpeedChoice:
    """The module docstring's steps from the singles to the choice (``run.cfg.speedup`` or
    ``run.cfg.target``; the target is judged by the fidelity measure, ``speedup`` by the judge)."""
    cfg = run.cfg
    singles = single_distortions(run, halves, menus)
    options = {n: {m: (cost.saving(n, m), max(singles[n][m], 0.0)) for m in menus[n] if cost.saving(n, m) > 0}
               for n in menus}
    front = [FrontPoint(_order(run, a), s, d, cost.predicted_speedup(a)) for s, d, a in pareto_front(options)]
    keep = [p for p in front if cfg.speedup is not None and p.speedup >= float(cfg.speedup)][:1]
    points = thin_front(front, keep=keep)
    measure = run.fidelity if cfg.speedup is None else run.judge
    judges = [h.judge for h in halves]
    judged = [replace(p, judged=judge_assignment(judges, measure, run.layers, menus, p.assignment).loss if p.assignment
                      else 0.0) for p in run.progress(points, len(points), "judging assignments")]
    chosen = choose_point(judged, cfg.speedup, None if cfg.speedup is not None else cfg.target)
    # the paper's protocol on the same axes: its layer count (67%) by its score, every one LATTE
    paper = {n: LATTE for n in select_by_score(scores(summed_stats(h.stats for h in halves), cfg.lam),
                                               num_linear_layers(len(run.layers), 0.67)) if LATTE in menus.get(n, {})}
    marks = {"paper protocol (67% by score, LATTE)": FrontPoint(
        _order(run, paper), sum(cost.saving(n, m) for n, m in paper.items()), 0.0, cost.predicted_speedup(paper),
        judge_assignment(judges, measure, run.layers, menus, paper).loss if paper else 0.0)}
    run.log(f"[latte] speed: {len(front)} assignments on the additive front, {len(judged)} judged by {measure.name}; "
            f"chosen: predicted {chosen.speedup:.2f}x, judged {chosen.judged:.4e}, "
            + ", ".join(f"{n}={m}" for n, m in chosen.assignment.items()))
    return SpeedChoice(chosen, judged, measure.name, singles, len(front), marks)
