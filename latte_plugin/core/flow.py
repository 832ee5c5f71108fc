"""The training-free flow on any model whose candidate layers carry :class:`LatteParams`.

:func:`calibrate_model` reads as its steps, and the steps follow it in call order: split the
images into roles -> record and fit every layer -> score -> select -> compensate -> held-out
figures -> apply -> report (``docs/architecture.md``, ``docs/method.md``). An adapter
(``latte_plugin.adapter``) supplies the model, this rank's batches, ``forward`` and ``all_reduce``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from .calibration import (REFIT_FALLBACK, AllReduce, FitResult, LayerRecorder, fit_correction, fit_layer,
                          no_reduce, set_correction, share_items)
from .fidelity import RawDistortion
from .flops import attention_gflops
from .judge import (ROLES, CalibrationSplit, CrossFitJudge, fold_assignment, judge_images, measured,
                    output_distortion, split_calibration)
from .layer import LatteParams, find_latte_layers, set_modes
from .selection import SensitivityStats, backward_select, greedy_select, num_linear_layers, select_by_score
from .settings import LatteConfig

__all__ = ["calibrate_model", "AUTO_SELECTIONS"]

#: Selections compared by ``selection='auto'``, the paper's score first (it wins ties).
AUTO_SELECTIONS = ("score", "greedy", "backward")


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    batches: Sequence[Any],
    forward: Callable[[Any], Any],
    cfg: LatteConfig,
    all_reduce: Optional[AllReduce] = None,
    log: Callable[[str], None] = print,
    progress: Callable[[Iterable, int, str], Iterable] = lambda it, total, desc: it,
    shard: tuple[int, int] = (0, 1),
    positions: Optional[Sequence[int]] = None,
    fidelity: Optional[Any] = None,
) -> dict:
    """Splits, records, fits, scores, selects and reports; leaves ``model`` hybrid.

    Args:
        model: a model whose candidate attention modules hold :class:`LatteParams`.
        batches: calibration batches (this rank's share), reused for every pass.
        forward: runs the model on one batch; returns its raw outputs (tensors, nested ok).
        cfg: the settings.
        all_reduce: sums a float64 tensor across ranks in place; identity when None.
        log: receives progress lines.
        progress: wraps an iterable in a progress bar: ``progress(iterable, total, description)``.
        shard: ``(rank, world_size)``.
        positions: the global position of each local batch (``latte_plugin.adapter.take_batches``);
            default: dealt round-robin, local batch ``i`` is global batch ``i * world_size + rank``.
        fidelity: the measure ``target`` budgets (:mod:`~latte_plugin.core.fidelity`); default:
            the relative raw-output distortion. Detector adapters pass
            :class:`~latte_plugin.core.fidelity.DetectionDisagreement`.

    Returns:
        ``{variant, candidates, sensitivity, linearized, params, fit, selection, attention_gflops, config, ...}``.
    """
    was_training = model.training
    run = _start(model, batches, forward, cfg, all_reduce or no_reduce, log, progress, shard, positions)
    fidelity = fidelity or RawDistortion(forward, relative=True)
    fits, corrections, targets = _calibrate_layers(run)
    sens, shapes = _score_sensitivity(run, run.split.fit)
    k = num_linear_layers(len(run.layers), cfg.ratio, cfg.num_linear)
    judged = judge_images(run.split, run.reduce)
    judge = CrossFitJudge(run.layers, corrections, judged, run.fold_of, run.reduce)
    chosen, trace, how = _select_layers(run, sens, k, judge, fidelity)
    k = len(chosen) if cfg.target is not None else k
    if chosen and targets is not None and cfg.compensate != "never":
        how["compensation"] = _choose_compensation(run, chosen, targets, corrections, judge, fits)
    held = _heldout_figures(run, chosen, fidelity)
    _apply_selection(run, chosen, sens)
    model.train(was_training)
    report = _build_report(run, k, chosen, sens, fits, trace, shapes, held.get("raw_mse"))
    n_judged = int(run.reduce(torch.tensor([float(len(judged))], dtype=torch.float64))[0])
    report["selection"].update(how, judge_images=n_judged, heldout=held)
    return report


@dataclass
class _Run:
    """What every step of one calibration shares (built once by :func:`_start`)."""

    layers: dict[str, LatteParams]
    cfg: LatteConfig
    split: CalibrationSplit
    fold_of: dict[int, int]
    forward: Callable[[Any], Any]
    reduce: AllReduce
    log: Callable[[str], None]
    progress: Callable[[Iterable, int, str], Iterable]
    shard: tuple[int, int]

    def refit_regs(self) -> tuple:
        """The ridge strengths to choose from (one fallback when nothing is held out to choose)."""
        regs = tuple(float(r) for r in self.cfg.refit_reg)
        if self.cfg.correction == "refit" and self.split.counts["choose"] == 0 and len(regs) > 1:
            return (REFIT_FALLBACK,)
        return regs


def _start(model: nn.Module, batches: Sequence[Any], forward: Callable[[Any], Any], cfg: LatteConfig,
           reduce: AllReduce, log: Callable[[str], None], progress: Callable, shard: tuple[int, int],
           positions: Optional[Sequence[int]]) -> _Run:
    """Checks the inputs, puts every layer exact in the chosen variant, and splits the images."""
    cfg.validate()
    layers = find_latte_layers(model)
    if not layers:
        raise ValueError("the model has no LATTE layers: swap the candidate attention modules in first")
    if float(reduce(torch.tensor([float(len(batches))], dtype=torch.float64))[0]) == 0:
        raise ValueError("empty calibration set: the calibration loader gave no batch; give num_images >= 1")
    for layer in layers.values():
        layer.variant = cfg.variant
        layer.mode = "exact"
    model.eval()
    rank, world = shard
    positions = list(positions) if positions is not None else [i * world + rank for i in range(len(batches))]
    split = split_calibration(list(batches), positions[: len(batches)], cfg, reduce)
    run = _Run(layers, cfg, split, fold_assignment(split, cfg, reduce, shard), forward, reduce, log, progress, shard)
    if cfg.correction == "refit" and run.refit_regs() != tuple(float(r) for r in cfg.refit_reg):
        log(f"[latte] no held-out images to choose the refit strength: using {REFIT_FALLBACK}")
    return run


def _calibrate_layers(run: _Run) -> tuple[dict, dict, Optional[dict]]:
    """Records and fits every layer (one group, or layer by layer with ``sequential``).

    Returns:
        ``(fits, corrections, exact targets)`` (:func:`_fit_layers`, :func:`_exact_targets`; no
        targets with ``sequential``, whose records are not the exact model's).
    """
    fits: dict[str, dict] = {}
    corrections: dict[str, tuple] = {}
    targets = None
    names = list(run.layers)
    for group in ([[n] for n in names] if run.cfg.sequential else [names]):
        recs = _record_layers(run, group, f"recording {group[0]}" if run.cfg.sequential else "recording")
        group_fits, group_corrections = _fit_layers(run, group, recs)
        fits.update(group_fits)
        corrections.update(group_corrections)
        if run.cfg.sequential:
            run.layers[group[0]].mode = "linear"
        else:
            targets = _exact_targets(recs)
    return fits, corrections, targets


def _record_layers(run: _Run, group: list[str], desc: str) -> dict[str, dict[str, LayerRecorder]]:
    """Runs every role's batches once with recorders on ``group``: ``{role: {layer: recorder}}``.

    Each image is keyed by its global position, so sampling and the ``max_items`` budget
    (applied across ranks) do not depend on the number of processes.
    """
    cfg, layers = run.cfg, run.layers
    recs = {role: {n: LayerRecorder(n, cfg.max_items, cfg.max_queries, cfg.seed) for n in group} for role in ROLES}
    try:
        for role in ROLES:
            part = getattr(run.split, role)
            for n in group:
                layers[n].recorder = recs[role][n]
            label = desc if role == "fit" else f"{desc} ({role} images)"
            for pos, batch in run.progress(part, len(part), label):
                for n in group:
                    recs[role][n].batch_key = pos
                run.forward(batch)
    finally:
        for n in group:
            layers[n].recorder = None
    for role in ROLES:
        for rec in recs[role].values():
            share_items(rec, run.reduce, run.shard)
    return recs


def _fit_layers(run: _Run, group: list[str], recs: dict) -> tuple[dict, dict]:
    """Fits each layer of ``group`` on its ``fit`` records (knobs on ``choose``, errors on ``report``).

    Returns:
        ``({layer: report entry}, {layer: (correction kind, weights, weights per fold)})``; the
        second feeds the cross-fitted judge.
    """
    cfg, fits, corrections = run.cfg, {}, {}
    for n in group:
        layer = run.layers[n]
        # every rank holds every item (share_items): no all-reduce, so the sums run in one fixed order
        res = fit_layer(layer, recs["fit"][n].items, cfg.steps, cfg.lr, cfg.correction, no_reduce, cfg.per_head,
                        choose=recs["choose"][n].items, report=recs["report"][n].items,
                        refit_regs=run.refit_regs(), fold_of=run.fold_of)
        fits[n], corrections[n] = _fit_entry(res), (res.kind, res.weights, res.fold_weights)
        held = "" if res.heldout_mse is None else f", held-out {res.heldout_mse:.3e}"
        run.log(f"[latte] fitted {n}: alpha={layer.alpha:.4f} rho={float(layer.log_rho.exp().mean()):.4g} "
                f"mse {res.initial_mse:.3e} -> {res.final_mse:.3e}{held} (steps {res.steps}, {res.correction})")
    return fits, corrections


def _fit_entry(res: FitResult) -> dict:
    """A layer's fit, as the report holds it."""
    return {"mse_initial": res.initial_mse, "mse_final": res.final_mse, "alpha_init": res.alpha_init,
            "heldout_mse": res.heldout_mse, "steps": res.steps, "refit_reg": res.refit_reg,
            "heldout": res.heldout, "choice": res.choice, "correction": res.correction}


def _exact_targets(recs: dict) -> dict[str, dict[int, Tensor]]:
    """``{layer: {item key: exact attention output}}`` of every role's records."""
    return {n: {it.key: it.target for role in ROLES for it in recs[role][n].items} for n in recs["fit"]}


class _Capture:
    """A layer probe that keeps the last output it saw."""

    def __init__(self, store: dict, name: str) -> None:
        self.store, self.name = store, name

    def __call__(self, out: Tensor) -> None:
        self.store[self.name] = out.detach()


def _score_sensitivity(run: _Run, batches: list) -> tuple[dict, dict]:
    """The paper's per-layer score (exact vs fully linear outputs, streamed) and each layer's
    mean token count ``{layer: (N, N)}``, over ``batches`` (``docs/method.md#selection``)."""
    layers, names = run.layers, list(run.layers)
    stats = {n: SensitivityStats() for n in names}
    tokens = torch.zeros(len(names), 2, dtype=torch.float64)  # (token rows, images) per layer
    captured: dict[str, Tensor] = {}
    for n in names:
        layers[n].probe = _Capture(captured, n)
    try:
        for _, batch in run.progress(batches, len(batches), "scoring"):
            outs = []
            for linear in ([], names):
                set_modes(layers, linear)
                captured.clear()
                run.forward(batch)
                outs.append(dict(captured))
            for i, n in enumerate(names):
                if n not in outs[0] or n not in outs[1]:
                    raise RuntimeError(f"layer {n} was not run by forward(); is it really used by the model?")
                stats[n].update(outs[0][n], outs[1][n])
                tokens[i] += torch.tensor([outs[0][n].shape[0] * outs[0][n].shape[1], outs[0][n].shape[0]])
    finally:
        for n in names:
            layers[n].probe = None
    for n in names:
        stats[n].sums = run.reduce(stats[n].sums)
    tokens = run.reduce(tokens)
    shapes = {n: (int(round(float(tokens[i, 0] / tokens[i, 1]))),) * 2 for i, n in enumerate(names)}
    return {n: stats[n].score(run.cfg.lam) for n in names}, shapes


def _select_layers(run: _Run, sens: dict[str, float], k: int, judge: CrossFitJudge,
                   fidelity: Any) -> tuple[list, list, dict]:
    """The layers to linearize (model order), the selection's trace and how they were chosen.

    A fixed selection without a target takes its ``k`` layers. ``selection='auto'`` takes the
    method whose ``k`` layers give the lowest cross-fitted raw-output MSE. With ``target``, the
    count is the largest whose cross-fitted ``fidelity`` loss, for some method, stays within the
    target (the lowest such loss wins) (``docs/method.md#selection``, ``#target``).
    """
    cfg = run.cfg
    methods = AUTO_SELECTIONS if cfg.selection == "auto" else (cfg.selection,)
    ks = list(range(1, len(run.layers) + 1)) if cfg.target is not None else [k]
    if not ks or max(ks) == 0:
        return [], [], {}
    distortion = output_distortion(run.layers, run.split.greedy, run.forward, run.reduce)
    sets, traces = _candidate_sets(methods, run.layers, sens, ks, distortion)
    if cfg.target is not None:
        method, k, info = _within_target(methods, sets, ks, float(cfg.target), judge(fidelity), fidelity.name)
    elif len(methods) == 1:
        method, info = methods[0], {}
    else:
        mse = judge(RawDistortion(run.forward, relative=False))  # the same measure as the compensation's
        info = {"crossfit_distortion": {m: mse(sets[(m, k)]) for m in methods}}
        method = min(methods, key=lambda m: (info["crossfit_distortion"][m], methods.index(m)))
    return sets.get((method, k), []), traces.get(method, []), {"chosen": method, **info}


def _candidate_sets(methods: Sequence[str], layers: dict[str, LatteParams], sens: dict[str, float],
                    ks: Sequence[int], distortion: Callable[[list[str]], float]) -> tuple[dict, dict]:
    """Each method's linear set for each count in ``ks``: ``({(method, k): layers}, {method: trace})``.

    Every method is nested (the set for ``k`` holds the set for ``k - 1``), so one run per
    method gives every count: greedy adds up to ``max(ks)``, backward restores down to ``min(ks)``.
    """
    names, sets, traces = list(layers), {}, {}
    for m in methods:
        if m == "score":
            order, traces[m] = select_by_score(sens, len(names)), []
            sets.update({(m, k): order[:k] for k in ks})
        elif m == "greedy":
            order, traces[m] = greedy_select(names, max(ks), distortion)
            sets.update({(m, k): order[:k] for k in ks})
        else:
            _, traces[m] = backward_select(names, min(ks), distortion)
            restored = [t["restored"] for t in traces[m] if t["restored"] is not None]
            sets.update({(m, k): [n for n in names if n not in restored[: len(names) - k]] for k in ks})
    return {key: [n for n in names if n in chosen] for key, chosen in sets.items()}, traces


def _within_target(methods: Sequence[str], sets: dict, ks: Sequence[int], target: float,
                   loss: Callable[[list[str]], float], measure: str) -> tuple[str, int, dict]:
    """From the most layers down: the first count where a method's set is within ``target``
    (``loss`` remembers sets that several methods share)."""
    losses: dict[int, dict[str, float]] = {}
    for k in sorted(ks, reverse=True):
        losses[k] = {m: loss(sets[(m, k)]) for m in methods}
        ok = [m for m in methods if losses[k][m] <= target]
        if ok:
            best = min(ok, key=lambda m: (losses[k][m], methods.index(m)))
            return best, k, {"target": {"target": target, "measure": measure, "k": k, "losses": losses}}
    return methods[0], 0, {"target": {"target": target, "measure": measure, "k": 0, "losses": losses}}


def _choose_compensation(run: _Run, chosen: list[str], targets: dict, corrections: dict, judge: CrossFitJudge,
                         fits: dict) -> dict:
    """Compensates the chosen layers (:func:`_compensate_layers`) and, with ``compensate='auto'``,
    keeps it only if the hybrid's cross-fitted raw-output MSE on the judging images is lower
    (ties keep the plain fit). Updates ``corrections`` and the layers in place; the compensated
    fits go to ``fits[layer]["compensated"]`` (``docs/method.md#compensation``)."""
    mse = RawDistortion(run.forward, relative=False)
    before = judge(mse)(chosen)
    comp_fits, comp = _compensate_layers(run, chosen, targets)
    after = judge(mse, {**corrections, **comp})(chosen)
    keep = run.cfg.compensate == "always" or after < before
    for n in chosen:
        fits[n]["compensated"] = comp_fits[n]
        if keep:
            corrections[n] = comp[n]
        kind, full, _ = corrections[n]
        set_correction(run.layers[n], kind, full)
    judge.forget()
    run.log(f"[latte] error compensation: cross-fitted output MSE {before:.4e} -> {after:.4e}: "
            f"{'kept' if keep else 'not kept'}")
    return {"crossfit_distortion": {"plain": before, "compensated": after}, "kept": keep}


def _compensate_layers(run: _Run, chosen: list[str], targets: dict) -> tuple[dict, dict]:
    """Error compensation: in model order, each chosen layer is recorded with the chosen layers
    before it already linear (and compensated), and its output correction is refitted to map
    those inputs to the *exact* model's attention output there (kernel scalars kept).

    Returns ``({layer: report entry}, {layer: (kind, weights, weights per fold)})``.
    """
    fits, corrections = {}, {}
    set_modes(run.layers, [])
    for n in chosen:
        recs = _record_layers(run, [n], f"compensating {n}")
        for role in ROLES:
            for it in recs[role][n].items:
                it.target = targets[n][it.key]
        res = fit_correction(run.layers[n], recs["fit"][n].items, run.cfg.correction, no_reduce,
                             recs["choose"][n].items, recs["report"][n].items, run.refit_regs(), run.fold_of)
        fits[n], corrections[n] = _fit_entry(res), (res.kind, res.weights, res.fold_weights)
        run.layers[n].mode = "linear"
    return fits, corrections


def _heldout_figures(run: _Run, chosen: list[str], fidelity: Any) -> dict:
    """The chosen layers' raw-output MSE and ``fidelity`` loss on the report images (nothing was
    fitted on them or chosen by them); empty without report images."""
    if not run.split.counts.get("report"):
        return {}
    report = run.split.report
    return {"raw_mse": output_distortion(run.layers, report, run.forward, run.reduce)(chosen),
            "fidelity": measured(run.layers, report, fidelity, run.reduce)(chosen), "measure": fidelity.name}


def _apply_selection(run: _Run, chosen: list[str], sens: dict[str, float]) -> None:
    """Puts the chosen layers in ``cfg.mode`` (the rest exact) and logs each layer's state."""
    set_modes(run.layers, chosen, run.cfg.mode)
    for layer in run.layers.values():
        layer.threshold.fill_(int(run.cfg.threshold))
    for n in run.layers:
        run.log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")


def _build_report(run: _Run, k: int, chosen: list[str], sens: dict, fits: dict, trace: list, shapes: dict,
                  heldout_distortion: Optional[float]) -> dict:
    """The calibration report (``docs/method.md#report``)."""
    layers, names = run.layers, list(run.layers)
    return {
        "variant": run.cfg.variant,
        "candidates": names,
        "sensitivity": sens,
        "linearized": chosen,
        "params": {n: layers[n].scalars() for n in names},
        "sigma_mean": {n: float(layers[n].sigma.mean()) for n in names},
        "fit": fits,
        "selection": {"method": run.cfg.selection, "k": k, "trace": trace, "heldout_distortion": heldout_distortion,
                      "images": dict(run.split.counts), "greedy_images": len(run.split.greedy)},
        "tokens": {n: shapes[n][0] for n in names},
        "attention_gflops": {"exact": attention_gflops(shapes, layers, []),
                             "linearized": attention_gflops(shapes, layers, chosen)},
        "config": run.cfg.to_dict(),
    }
