"""The training-free flow on any model whose candidate layers carry :class:`LatteParams`.

:func:`calibrate_model` reads as its steps, and the steps follow it in call order: split the
images into roles -> record and fit every layer (every correction rule) -> score -> search
the candidate sets -> judge the whole configurations -> compensate -> held-out figures ->
apply -> report (``docs/architecture.md``, ``docs/method.md``). An adapter
(``latte_plugin.adapter``) supplies the model, this rank's batches, ``forward`` and ``all_reduce``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from .calibration import CORRECTION_RULES, AllReduce, fit_layer, no_reduce, set_correction
from .choice import Configuration, choose_configuration, configuration_name, target_count
from .fidelity import RawDistortion
from .judge import (ROLES, CalibrationSplit, CrossFitJudge, HalfSearch, across_halves, configuration_judge, fold_assignment,
                    measured, merged, on_every_image, output_distortion, split_calibration)
from .recording import compensate_layers, record_layers
from .layer import LatteParams, find_latte_layers, layer_states, restore_layer_states, set_modes
from .report import build_report, fit_entry
from .selection import candidate_sets, num_linear_layers, score_stats, scores, select_by_score, summed_stats, trace_up_to
from .settings import LatteConfig
from .signal import attention_signal

__all__ = ["calibrate_model", "calibrate_model_ratios", "AUTO_SELECTIONS"]

#: Selections compared by ``selection='auto'``, the paper's score first (it wins ties).
AUTO_SELECTIONS = ("score", "greedy", "backward")


def calibrate_model(model: nn.Module, batches: Sequence[Any], forward: Callable[[Any], Any], cfg: LatteConfig,
                    **kwargs: Any) -> dict:
    """Splits, records, fits, scores, selects and reports; leaves ``model`` hybrid
    (:func:`calibrate_model_ratios` with ``cfg``'s own count; the same arguments but ``ratios``).
    Returns ``{variant, candidates, sensitivity, linearized, params, fit, selection, config, ...}``."""
    return next(calibrate_model_ratios(model, batches, forward, cfg, None, **kwargs))


@torch.no_grad()
def calibrate_model_ratios(
    model: nn.Module,
    batches: Sequence[Any],
    forward: Callable[[Any], Any],
    cfg: LatteConfig,
    ratios: Optional[Sequence[float]] = None,
    all_reduce: Optional[AllReduce] = None,
    log: Callable[[str], None] = print,
    progress: Callable[[Iterable, int, str], Iterable] = lambda it, total, desc: it,
    shard: tuple[int, int] = (0, 1),
    positions: Optional[Sequence[int]] = None,
    fidelity: Optional[Any] = None,
) -> Iterator[dict]:
    """Calibrates for several linear shares at once: yields, for each of ``ratios`` in turn, the
    report a separate :func:`calibrate_model` with ``ratio`` set would give, with the model left
    in that share's hybrid until the next report is asked for.

    Split, record, fit, score and search run once (every search is nested: one run gives every
    count); each share then configures from the same saved state (``docs/architecture.md``).
    The signal (the exact model's) is measured for the first share only.

    Args:
        model: a model whose candidate attention modules hold :class:`LatteParams`.
        batches: calibration batches (this rank's share), reused for every pass.
        forward: runs the model on one batch; returns its raw outputs (tensors, nested ok).
        cfg: the settings.
        ratios: the linear shares; ``None``: ``cfg``'s own count (or ``target``) only.
        all_reduce: sums a float64 tensor across ranks in place; identity when None.
        log: receives progress lines.
        progress: wraps an iterable in a progress bar: ``progress(iterable, total, description)``.
        shard: ``(rank, world_size)``.
        positions: the global position of each local batch (``latte_plugin.adapter.take_batches``);
            default: dealt round-robin, local batch ``i`` is global batch ``i * world_size + rank``.
        fidelity: the measure ``target`` budgets (:mod:`~latte_plugin.core.fidelity`); default:
            the relative raw-output distortion. Detector adapters pass
            :class:`~latte_plugin.core.fidelity.DetectionDisagreement`.
    """
    if ratios is not None and cfg.target is not None:
        raise ValueError("target= chooses its own layer count: calibrate it on its own, without ratios")
    cfgs = [cfg] if ratios is None else [replace(cfg, ratio=float(r), num_linear=None) for r in ratios]
    was_training = model.training
    run = _start(model, batches, forward, cfg, all_reduce or no_reduce, log, progress, shard, positions)
    run.judge, fidelity = configuration_judge(cfg, forward, fidelity), fidelity or RawDistortion(forward, relative=True)
    fits, corrections, targets = _calibrate_layers(run)
    counts = [num_linear_layers(len(run.layers), c.ratio, c.num_linear) for c in cfgs]
    ks = list(range(1, len(run.layers) + 1)) if cfg.target is not None else sorted(set(counts))
    halves = [_search_half(run, i, corrections, ks) for i in range(len(run.split.halves))]
    shared, signal = layer_states(run.layers), None
    for c, k in zip(cfgs, counts):
        restore_layer_states(run.layers, shared)
        report = _configure(replace(run, cfg=c), halves, ks if c.target is not None else [k], k,
                            {n: dict(f) for n, f in fits.items()}, dict(corrections), targets, fidelity, signal)
        signal = report.get("signal")
        model.train(was_training)
        yield report


def _configure(run: "_Run", halves: list, ks: Sequence[int], k: int, fits: dict, corrections: dict,
               targets: Optional[dict], fidelity: Any, signal: Optional[dict]) -> dict:
    """One share's steps (``k`` layers, or ``target``'s count among ``ks``), from choosing the
    configuration to the report; ``fits`` and ``corrections`` are its own copies."""
    cfg = run.cfg
    chosen, how = _select_configuration(run, halves, ks, k, corrections, fidelity)
    k = chosen.k if cfg.target is not None else k
    chosen, trace = _final_set(run, chosen, halves, corrections, how)
    if cfg.target is None:  # the searches may have run past k for another share
        trace = trace_up_to(chosen.method, trace, k, len(run.layers))
    if chosen.layers and targets is not None and cfg.compensate != "never":
        chosen, how["compensation"] = _choose_compensation(run, chosen, targets, corrections, halves, fidelity, fits)
    _install_corrections(run, chosen, corrections, fits)
    held = _heldout_figures(run, chosen, corrections, halves, fidelity)
    sens = scores(summed_stats(h.stats for h in halves), cfg.lam)
    _apply_selection(run, chosen.layers, sens)
    if signal is None:
        signal = attention_signal(run.layers, [b for _, b in run.split.used], run.forward, run.reduce) if cfg.signal else {}
    report = build_report(run.layers, cfg, run.split, run.reduce, k, chosen.layers, sens, fits, trace,
                          sum(h.tokens for h in halves), held.get("raw_mse"), signal)
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
    judge: Any = None  # what judges whole configurations and the compensation (configuration_judge)
    runs_once: set = field(default_factory=set)  # layers seen to run once per forward (recording.record_layers)
    compensated: dict = field(default_factory=dict)  # compensation refits, shared by the shares (compensate_layers)

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
        recs = record_layers(run, group, f"recording {group[0]}" if run.cfg.sequential else "recording")
        group_fits, group_corrections = _fit_layers(run, group, recs)
        fits.update(group_fits)
        for rule in run.rules:
            corrections[rule].update(group_corrections[rule])
        if run.cfg.sequential:
            run.layers[group[0]].mode = "linear"
        else:
            targets = _exact_targets(recs)
    return fits, corrections, targets


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


def _search_half(run: _Run, i: int, corrections: dict, ks: Sequence[int]) -> HalfSearch:
    """Scores half ``i`` and runs every selection method on it (cross-fitted, the user's rule)."""
    stats, tokens = score_stats(run, run.split.halves[i], corrections[run.cfg.correction])
    searcher = CrossFitJudge(run.layers, run.split.greedy[i], run.fold_of, run.reduce)
    sets, traces = _search(run, [searcher], scores(stats, run.cfg.lam), ks, corrections, run.methods)
    return HalfSearch(CrossFitJudge(run.layers, run.split.halves[i], run.fold_of, run.reduce), searcher, stats, tokens,
                      sets, traces)


def _search(run: _Run, searchers: list, sens: dict, ks: Sequence[int], corrections: dict, methods: Sequence[str]):
    """``candidate_sets`` with every set measured by the cross-fitted raw-output MSE on the
    searchers' images together (each searcher remembers what it measured)."""
    mse, rule = RawDistortion(run.forward, relative=False), run.cfg.correction
    return candidate_sets(methods, run.layers, sens, ks,
                          lambda s: merged([j(mse, corrections[rule], rule)(s) for j in searchers], mse).loss)


def _select_configuration(run: _Run, halves: list, ks: Sequence[int], k: int, corrections: dict,
                          fidelity: Any) -> tuple[Configuration, dict]:
    """The configuration to apply (its layers are set by :func:`_final_set`) and how it was
    chosen (``docs/method.md#configurations``): every (method, rule) pair judged across the
    halves, and :func:`choose_configuration` keeps the paper's choice unless another gains more
    than its noise. With ``target``, the count is the largest where some method's pair with
    the user's rule is within the target, and only pairs within it compete."""
    cfg, pairs = run.cfg, [(m, r) for m in run.methods for r in run.rules]
    if not ks or max(ks) == 0:
        return Configuration(run.methods[0], cfg.correction, []), {}
    measure, info = run.judge, {}
    if cfg.target is not None:
        measure = fidelity
        k, info = target_count(run.methods, ks, float(cfg.target),
                               lambda m, j: across_halves(halves, fidelity, corrections, cfg.correction, m, j))
        info["target"]["measure"] = fidelity.name
    if len(pairs) == 1 or k == 0:
        return Configuration(pairs[0][0], pairs[0][1], [], k=k), {"chosen": pairs[0][0], **info}
    verdicts = {configuration_name(m, r): across_halves(halves, measure, corrections, r, m, k) for m, r in pairs}
    if cfg.target is not None:
        verdicts = {n: v for n, v in verdicts.items() if v.loss <= float(cfg.target)}
    name, comparison = choose_configuration(verdicts)
    method, rule = next((m, r) for m, r in pairs if configuration_name(m, r) == name)
    comparison["layers"] = {configuration_name(m, r): [h.sets[(m, k)] for h in halves] for m, r in pairs}
    run.log(f"[latte] configuration: {name} (cross-fitted {measure.name}: "
            + ", ".join(f"{n} {v:.4e}" for n, v in comparison["losses"].items()) + ")")
    return Configuration(method, rule, [], k=k), {"chosen": method, "comparison": comparison, "measure": measure.name,
                                                  **info}


def _final_set(run: _Run, chosen: Configuration, halves: list, corrections: dict, how: dict) -> tuple:
    """The chosen configuration refitted on every image: with one half, its search's set; a
    ``score`` set from the score summed over both halves; a search's set where both halves'
    searches agree, else the search run again on every image. Returns ``(configuration, trace)``."""
    m, k = chosen.method, chosen.k
    if not k:
        return chosen, []
    if len(halves) == 1:
        return replace(chosen, layers=halves[0].sets[(m, k)]), halves[0].traces.get(m, [])
    if m == "score":
        layers, trace = select_by_score(scores(summed_stats(h.stats for h in halves), run.cfg.lam), k), []
    elif set(halves[0].sets[(m, k)]) == set(halves[1].sets[(m, k)]):
        layers, trace = halves[0].sets[(m, k)], halves[0].traces.get(m, [])
    else:
        sets, traces = _search(run, [h.searcher for h in halves], {}, [k], corrections, (m,))
        layers, trace = sets[(m, k)], traces.get(m, [])
        how["searched_again"] = "the halves' searches disagreed: searched again on every image"
    return replace(chosen, layers=[n for n in run.layers if n in layers]), trace


def _choose_compensation(run: _Run, chosen: Configuration, targets: dict, corrections: dict, halves: list,
                         fidelity: Any, fits: dict) -> tuple[Configuration, dict]:
    """Compensates the chosen layers (:func:`~.recording.compensate_layers`) and, with ``compensate='auto'``,
    keeps it only if the hybrid's cross-fitted ``run.judge`` loss on every fit and choice image is lower
    (ties keep the plain fit) and, with ``target``, its fidelity loss is still within the target.
    The compensated corrections join ``corrections`` under ``<rule>+compensation``; the
    compensated fits go to ``fits[layer]["compensated"]`` (``docs/method.md#compensation``)."""
    judge = run.judge
    compensated = replace(chosen, compensated=True)
    key = compensated.corrections_key
    before = on_every_image(halves, judge, corrections[chosen.rule], chosen.rule, chosen.layers).loss
    comp_fits, comp = compensate_layers(run, chosen, targets)
    corrections[key] = {**corrections[chosen.rule], **comp}
    after = on_every_image(halves, judge, corrections[key], key, chosen.layers).loss
    keep = run.cfg.compensate == "always" or after < before
    info = {"crossfit_distortion": {"plain": before, "compensated": after}, "measure": judge.name}
    if keep and run.cfg.target is not None and run.cfg.compensate == "auto":
        info["target_loss"] = on_every_image(halves, fidelity, corrections[key], key, chosen.layers).loss
        keep = info["target_loss"] <= float(run.cfg.target)  # re-judged: dropped if it breaks the budget
    for n in chosen.layers:
        fits[n]["compensated"] = comp_fits[n]
    run.log(f"[latte] error compensation: cross-fitted {judge.name} {before:.4e} -> {after:.4e}: "
            f"{'kept' if keep else 'not kept'}")
    return (compensated if keep else chosen), {**info, "kept": keep}


def _install_corrections(run: _Run, chosen: Configuration, corrections: dict, fits: dict) -> None:
    """Gives every layer the chosen configuration's correction, fitted on every fit and choice
    image, and records which candidate each layer took in ``fits[layer]["applied"]``."""
    for n, corr in corrections[chosen.corrections_key].items():
        set_correction(run.layers[n], corr.kind, corr.weights)
        fits[n]["applied"] = corr.name


def _heldout_figures(run: _Run, chosen: Configuration, corrections: dict, halves: list, fidelity: Any) -> dict:
    """The chosen configuration's raw-output MSE and ``fidelity`` loss on the report images when
    there are any (nothing was fitted on or chosen by them), else its raw-output MSE on every
    fit and choice image, cross-fitted (no image measured with a correction fitted on it; the
    images did choose the configuration and its set: ``docs/method.md#report``), and the
    fidelity loss where ``target`` already measured it. Empty without linear layers."""
    if not chosen.layers:
        return {}
    if run.split.counts.get("report"):
        report = run.split.report
        return {"raw_mse": output_distortion(run.layers, report, run.forward, run.reduce)(chosen.layers),
                "fidelity": measured(run.layers, report, fidelity, run.reduce)(chosen.layers),
                "measure": fidelity.name, "kind": "report images", "images": run.split.counts["report"]}
    corr, key = corrections[chosen.corrections_key], chosen.corrections_key
    raw = on_every_image(halves, RawDistortion(run.forward, relative=False), corr, key, chosen.layers)
    fid = on_every_image(halves, fidelity, corr, key, chosen.layers).loss if run.cfg.target is not None else None
    return {"raw_mse": raw.loss, "fidelity": fid, "measure": fidelity.name, "kind": "cross-fitted",
            "images": int(raw.per_image.numel())}


def _apply_selection(run: _Run, chosen: list[str], sens: dict[str, float]) -> None:
    """Puts the chosen layers in ``cfg.mode`` (the rest exact) and logs each layer's state."""
    set_modes(run.layers, chosen, run.cfg.mode)
    for layer in run.layers.values():
        layer.threshold.fill_(int(run.cfg.threshold))
    for n in run.layers:
        run.log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")
