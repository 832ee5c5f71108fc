"""The training-free flow on any model whose candidate layers carry :class:`LatteParams`.

:func:`calibrate_model` reads as its steps, and the steps follow it in call order: split the
images into roles -> record and fit every layer (every correction rule) -> score -> search
the candidate sets -> judge the whole configurations -> compensate -> held-out figures ->
apply -> report (``docs/architecture.md``, ``docs/method.md``). An adapter
(``latte_plugin.adapter``) supplies the model, this rank's batches, ``forward`` and ``all_reduce``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from .calibration import (CORRECTION_RULES, AllReduce, FittedCorrection, LayerRecorder, fit_correction,
                          fit_layer, no_reduce, set_correction, share_items)
from .choice import Configuration, choose_configuration, target_count
from .fidelity import RawDistortion
from .judge import ROLES, CalibrationSplit, CrossFitJudge, fold_assignment, measured, output_distortion, split_calibration
from .layer import LatteParams, find_latte_layers, set_modes
from .report import build_report, fit_entry
from .selection import LastOutput, SensitivityStats, candidate_sets, num_linear_layers, scores, select_by_score
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
    stats, tokens = _score_stats(run, run.split.search, corrections[cfg.correction])
    k = num_linear_layers(len(run.layers), cfg.ratio, cfg.num_linear)
    judge = CrossFitJudge(run.layers, run.split.judge, run.fold_of, run.reduce)
    chosen, trace, how = _select_configuration(run, scores(stats, cfg.lam), k, corrections, judge, fidelity)
    k = len(chosen.layers) if cfg.target is not None else k
    if chosen.method == "score" and chosen.layers and run.split.judge_apart:
        chosen, stats, tokens = _rescore(run, chosen, stats, tokens, corrections)
        how["rescored"] = "the score set taken again from the search and judging images' summed score"
    if chosen.layers and targets is not None and cfg.compensate != "never":
        chosen, how["compensation"] = _choose_compensation(run, chosen, targets, corrections, judge, fidelity, fits)
    _install_corrections(run, chosen, corrections, fits)
    held = _heldout_figures(run, chosen, corrections, judge, fidelity)
    sens = scores(stats, cfg.lam)
    _apply_selection(run, chosen.layers, sens)
    model.train(was_training)
    report = build_report(run.layers, cfg, run.split, run.reduce, k, chosen.layers, sens, fits, trace, tokens,
                          held.get("raw_mse"))
    report["selection"].update(how, configuration=chosen.name, heldout=held)
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

    @property
    def rules(self) -> tuple:
        """The correction rules whole configurations compare (the user's, or all with ``auto``)."""
        return CORRECTION_RULES if self.cfg.correction == "auto" else (self.cfg.correction,)

    @property
    def methods(self) -> tuple:
        """The selection methods whole configurations compare (the user's, or all with ``auto``)."""
        return AUTO_SELECTIONS if self.cfg.selection == "auto" else (self.cfg.selection,)


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
    return _Run(layers, cfg, split, fold_assignment(split, cfg, reduce, shard), forward, reduce, log, progress, shard)


def _calibrate_layers(run: _Run) -> tuple[dict, dict, Optional[dict]]:
    """Records and fits every layer (one group, or layer by layer with ``sequential``).

    Returns:
        ``(fits, {rule: {layer: FittedCorrection}}, exact targets)`` (:func:`_fit_layers`,
        :func:`_exact_targets`; no targets with ``sequential``, whose records are not the exact model's).
    """
    fits: dict[str, dict] = {}
    corrections: dict[str, dict] = {r: {} for r in run.rules}
    targets = None
    names = list(run.layers)
    for group in ([[n] for n in names] if run.cfg.sequential else [names]):
        recs = _record_layers(run, group, f"recording {group[0]}" if run.cfg.sequential else "recording")
        group_fits, group_corrections = _fit_layers(run, group, recs)
        fits.update(group_fits)
        for rule in run.rules:
            corrections[rule].update(group_corrections[rule])
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
        ``({layer: report entry}, {rule: {layer: FittedCorrection}})``; the second feeds the
        cross-fitted judge.
    """
    cfg, fits, corrections = run.cfg, {}, {r: {} for r in run.rules}
    for n in group:
        layer = run.layers[n]
        # every rank holds every item (share_items): no all-reduce, so the sums run in one fixed order
        res = fit_layer(layer, recs["fit"][n].items, cfg.steps, cfg.lr, cfg.correction, no_reduce, cfg.per_head,
                        choose=recs["choose"][n].items, report=recs["report"][n].items,
                        refit_regs=tuple(run.cfg.refit_reg), fold_of=run.fold_of, rules=run.rules)
        fits[n] = fit_entry(res)
        for rule in run.rules:
            corrections[rule][n] = res.rules[rule]
        held = "" if res.heldout_mse is None else f", held-out {res.heldout_mse:.3e}"
        run.log(f"[latte] fitted {n}: alpha={layer.alpha:.4f} rho={float(layer.log_rho.exp().mean()):.4g} "
                f"mse {res.initial_mse:.3e} -> {res.final_mse:.3e}{held} (steps {res.steps}, {res.correction})")
    return fits, corrections


def _exact_targets(recs: dict) -> dict[str, dict[int, Tensor]]:
    """``{layer: {item key: exact attention output}}`` of every role's records."""
    return {n: {it.key: it.target for role in ROLES for it in recs[role][n].items} for n in recs["fit"]}


def _score_stats(run: _Run, batches: list, corrections: dict[str, FittedCorrection]) -> tuple[dict, Tensor]:
    """The paper's per-layer score statistics (exact vs fully linear outputs, streamed; summed
    across ranks, so they add up over image sets) and ``(token rows, images)`` per layer, over
    ``batches`` (``docs/method.md#selection``); each image's linear pass uses the corrections
    fitted without its fold."""
    layers, names = run.layers, list(run.layers)
    stats = {n: SensitivityStats() for n in names}
    tokens = torch.zeros(len(names), 2, dtype=torch.float64)
    captured: dict[str, Tensor] = {}
    for n in names:
        layers[n].probe = LastOutput(captured, n)
    try:
        for pos, batch in run.progress(batches, len(batches), "scoring"):
            outs = []
            for n in names:
                set_correction(layers[n], *corrections[n].folds[run.fold_of[pos]])
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
            set_correction(layers[n], corrections[n].kind, corrections[n].weights)
    for n in names:
        stats[n].sums = run.reduce(stats[n].sums)
    return stats, run.reduce(tokens)


def _rescore(run: _Run, chosen: Configuration, stats: dict, tokens: Tensor, corrections: dict) -> tuple:
    """A chosen score configuration refitted on every image: the judging images' score statistics
    join the search images', and the set is the ``k`` lowest of the summed score (item 3 of
    ``docs/method.md#configurations``). Returns ``(configuration, stats, tokens)``."""
    more, more_tokens = _score_stats(run, run.split.judge, corrections[chosen.rule])
    for n, st in stats.items():
        st.sums = st.sums + more[n].sums
    layers = select_by_score(scores(stats, run.cfg.lam), len(chosen.layers))
    return replace(chosen, layers=[n for n in run.layers if n in layers]), stats, tokens + more_tokens


def _select_configuration(run: _Run, sens: dict[str, float], k: int, corrections: dict, judge: CrossFitJudge,
                          fidelity: Any) -> tuple[Configuration, list, dict]:
    """The configuration to apply, its search's trace and how it was chosen
    (``docs/method.md#configurations``).

    Each selection method's sets come from searches on the search images under the user's
    correction rule, every set measured with cross-fitted corrections; every (method, rule)
    pair is then judged on the judging images and :func:`choose_configuration` keeps the
    paper's choice unless another gains more than its noise. With ``target``, the count is the
    largest where some method's set is within the target, and only candidates within it compete.
    """
    cfg = run.cfg
    ks = list(range(1, len(run.layers) + 1)) if cfg.target is not None else [k]
    if not ks or max(ks) == 0:
        return Configuration(run.methods[0], cfg.correction, []), [], {}
    mse = RawDistortion(run.forward, relative=False)
    searcher = CrossFitJudge(run.layers, run.split.greedy, run.fold_of, run.reduce)
    search = searcher(mse, corrections[cfg.correction], cfg.correction)
    sets, traces = candidate_sets(run.methods, run.layers, sens, ks, lambda s: search(s).loss)
    info: dict = {}
    measure = mse
    if cfg.target is not None:
        measure = fidelity
        k, info = target_count(run.methods, sets, ks, float(cfg.target),
                               judge(fidelity, corrections[cfg.correction], cfg.correction))
        info["target"]["measure"] = fidelity.name
        if k == 0:
            return Configuration(run.methods[0], cfg.correction, []), [], {"chosen": run.methods[0], **info}
    configs = [Configuration(m, r, sets[(m, k)]) for m in run.methods for r in run.rules]
    if len(configs) == 1:
        return configs[0], traces.get(configs[0].method, []), {"chosen": configs[0].method, **info}
    verdicts = {c.name: judge(measure, corrections[c.rule], c.rule)(c.layers) for c in configs}
    if cfg.target is not None:
        verdicts = {n: v for n, v in verdicts.items() if v.loss <= float(cfg.target)}
    name, comparison = choose_configuration(verdicts)
    chosen = next(c for c in configs if c.name == name)
    comparison["layers"] = {c.name: c.layers for c in configs if c.name in verdicts}
    run.log(f"[latte] configuration: {name} (cross-fitted {measure.name} "
            + ", ".join(f"{n} {v:.4e}" for n, v in comparison["losses"].items()) + ")")
    return chosen, traces.get(chosen.method, []), {"chosen": chosen.method, "comparison": comparison,
                                                   "measure": measure.name, **info}


def _choose_compensation(run: _Run, chosen: Configuration, targets: dict, corrections: dict, judge: CrossFitJudge,
                         fidelity: Any, fits: dict) -> tuple[Configuration, dict]:
    """Compensates the chosen layers (:func:`_compensate_layers`) and, with ``compensate='auto'``,
    keeps it only if the hybrid's cross-fitted raw-output MSE on the judging images is lower
    (ties keep the plain fit) and, with ``target``, its fidelity loss is still within the target.
    The compensated corrections join ``corrections`` under ``<rule>+compensation``; the
    compensated fits go to ``fits[layer]["compensated"]`` (``docs/method.md#compensation``)."""
    mse = RawDistortion(run.forward, relative=False)
    compensated = Configuration(chosen.method, chosen.rule, chosen.layers, compensated=True)
    key = compensated.corrections_key
    before = judge(mse, corrections[chosen.rule], chosen.rule)(chosen.layers).loss
    comp_fits, comp = _compensate_layers(run, chosen, targets)
    corrections[key] = {**corrections[chosen.rule], **comp}
    after = judge(mse, corrections[key], key)(chosen.layers).loss
    keep = run.cfg.compensate == "always" or after < before
    info = {"crossfit_distortion": {"plain": before, "compensated": after}}
    if keep and run.cfg.target is not None and run.cfg.compensate == "auto":
        info["target_loss"] = judge(fidelity, corrections[key], key)(chosen.layers).loss
        keep = info["target_loss"] <= float(run.cfg.target)  # re-judged: dropped if it breaks the budget
    for n in chosen.layers:
        fits[n]["compensated"] = comp_fits[n]
    run.log(f"[latte] error compensation: cross-fitted output MSE {before:.4e} -> {after:.4e}: "
            f"{'kept' if keep else 'not kept'}")
    return (compensated if keep else chosen), {**info, "kept": keep}


def _compensate_layers(run: _Run, chosen: Configuration, targets: dict) -> tuple[dict, dict]:
    """Error compensation: in model order, each chosen layer is recorded with the chosen layers
    before it already linear (and compensated), and its output correction (the chosen rule)
    is refitted to map those inputs to the *exact* model's attention output there (kernel
    scalars kept).

    Returns ``({layer: report entry}, {layer: FittedCorrection})``.
    """
    fits, corrections = {}, {}
    set_modes(run.layers, [])
    for n in chosen.layers:
        recs = _record_layers(run, [n], f"compensating {n}")
        for role in ROLES:
            for it in recs[role][n].items:
                it.target = targets[n][it.key]
        res = fit_correction(run.layers[n], recs["fit"][n].items, chosen.rule, no_reduce,
                             recs["choose"][n].items, recs["report"][n].items, tuple(run.cfg.refit_reg), run.fold_of)
        fits[n], corrections[n] = fit_entry(res), res.rules[chosen.rule]
        run.layers[n].mode = "linear"
    return fits, corrections


def _install_corrections(run: _Run, chosen: Configuration, corrections: dict, fits: dict) -> None:
    """Gives every layer the chosen configuration's correction, fitted on every fit and choice
    image, and records which candidate each layer took in ``fits[layer]["applied"]``."""
    for n, corr in corrections[chosen.corrections_key].items():
        set_correction(run.layers[n], corr.kind, corr.weights)
        fits[n]["applied"] = corr.name


def _heldout_figures(run: _Run, chosen: Configuration, corrections: dict, judge: CrossFitJudge,
                     fidelity: Any) -> dict:
    """The chosen configuration's raw-output MSE and ``fidelity`` loss: on the report images
    when there are any (nothing was fitted on or chosen by them), else cross-fitted on the
    judging images (no image judged a correction fitted on it, but these images chose the
    configuration: ``docs/method.md#report``). Empty without linear layers."""
    if not chosen.layers:
        return {}
    if run.split.counts.get("report"):
        report = run.split.report
        return {"raw_mse": output_distortion(run.layers, report, run.forward, run.reduce)(chosen.layers),
                "fidelity": measured(run.layers, report, fidelity, run.reduce)(chosen.layers),
                "measure": fidelity.name, "kind": "report images", "images": run.split.counts["report"]}
    corr, key = corrections[chosen.corrections_key], chosen.corrections_key
    mse = RawDistortion(run.forward, relative=False)
    raw, fid = judge(mse, corr, key)(chosen.layers), judge(fidelity, corr, key)(chosen.layers)
    return {"raw_mse": raw.loss, "fidelity": fid.loss, "measure": fidelity.name, "kind": "cross-fitted",
            "images": int(raw.per_image.numel())}


def _apply_selection(run: _Run, chosen: list[str], sens: dict[str, float]) -> None:
    """Puts the chosen layers in ``cfg.mode`` (the rest exact) and logs each layer's state."""
    set_modes(run.layers, chosen, run.cfg.mode)
    for layer in run.layers.values():
        layer.threshold.fill_(int(run.cfg.threshold))
    for n in run.layers:
        run.log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")
