"""The training-free flow on any model whose candidate layers carry
:class:`~latte_plugin.nn.params.LatteParams`.

:func:`calibrate_model_ratios` reads as its steps, and the steps follow it in call order: split
the images into roles -> record and fit every layer (every correction rule) -> score and search
each half -> per linear share: judge the whole configurations -> the final set -> compensate ->
install the corrections -> held-out figures -> apply -> report (``docs/architecture.md``,
``docs/method.md``). An adapter (``latte_plugin.adapter``) supplies the model, this rank's
batches and a :class:`~latte_plugin.calibration.context.Host` (``forward``, the all-reduce, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from ..nn.install import find_latte_layers, layer_states, restore_layer_states, set_modes
from .compensate import compensate_layers
from .cost import CostModel, load_cost_model, measure_costs, measured_speedup, whole_network
from .config import LatteConfig, num_linear_layers
from .context import ROLES, CalibrationRun, Host, Measure
from .corrections import CorrectionTable, FitOptions, LayerRecords, set_correction
from .fit import fit_records
from .judge import (CrossFitJudge, HalfSearch, Verdict, across_halves, configuration_judge, fold_assignment, measured, merged,
                    on_every_image, output_distortion, search_measure, split_calibration, confirmed_set)
from .measures import RawDistortion
from .record import record_layers
from .report import ShareResult, build_report, fit_entry
from .select import (NOISE_Z, Configuration, candidate_sets, choose_configuration, configuration_name, paired_gain,
                     score_stats, scores, select_by_score, summed_stats, target_count, trace_up_to)
from .signal import attention_signal
from .speed import check_reachable, fit_modes, install_assignment, speed_front

__all__ = ["calibrate_model", "calibrate_model_ratios"]


def calibrate_model(model: nn.Module, batches: Sequence[Any], forward: Callable[[Any], Any], cfg: LatteConfig,
                    **host: Any) -> dict:
    """Splits, records, fits, scores, selects and reports; leaves ``model`` hybrid
    (:func:`calibrate_model_ratios` with ``cfg``'s own count).

    Args:
        model, batches, forward, cfg: as in :func:`calibrate_model_ratios`.
        **host: the other :class:`~latte_plugin.calibration.context.Host` fields by name
            (``all_reduce``, ``log``, ``progress``, ``shard``, ``positions``, ``fidelity``).

    Returns:
        ``{variant, candidates, sensitivity, linearized, params, fit, selection, config, ...}``.
    """
    return next(calibrate_model_ratios(model, batches, Host(forward, **host), cfg))


@dataclass(frozen=True)
class _Fitted:
    """What steps 1-3 leave for every linear share: the layers' report entries, every rule's
    corrections, the exact model's attention outputs (``None`` with ``sequential``), each
    half's search, the counts searched and the layers' fitted state."""

    fits: Mapping[str, dict]
    corrections: CorrectionTable
    targets: Optional[dict[str, dict[int, Tensor]]]
    halves: list[HalfSearch]
    ks: list[int]
    states: dict = field(repr=False, default_factory=dict)
    menus: Mapping[str, Mapping] = field(repr=False, default_factory=dict)  # speed: {layer: {mode: ModeFit}}
    cost: Optional[CostModel] = None


@torch.no_grad()
def calibrate_model_ratios(model: nn.Module, batches: Sequence[Any], host: Host, cfg: LatteConfig,
                           ratios: Optional[Sequence[float]] = None) -> Iterator[dict]:
    """Calibrates for several linear shares at once: yields, for each of ``ratios`` in turn, the
    report a separate :func:`calibrate_model` with ``ratio`` set would give, with the model left
    in that share's hybrid until the next report is asked for.

    Split, record, fit, score and search run once (every search is nested: one run gives every
    count); each share then configures from the same saved state (``docs/architecture.md``).
    The signal (the exact model's) is measured for the first share only.

    Args:
        model: a model whose candidate attention modules hold ``LatteParams``.
        batches: calibration batches (this rank's share), reused for every pass.
        host: what the caller supplies (``forward``, the all-reduce, the log, ...).
        cfg: the settings. ratios: the linear shares; ``None``: ``cfg``'s own count (or ``target``) only.
    """
    if ratios is not None and (cfg.target is not None or cfg.for_speed):
        raise ValueError("target= and speedup= choose their own layers: calibrate them on their own, without ratios")
    cfgs = [cfg] if ratios is None else [replace(cfg, ratio=float(r), num_linear=None) for r in ratios]
    was_training = model.training
    run = _start(model, batches, host, cfg)
    counts = [num_linear_layers(len(run.layers), c.ratio, c.num_linear) for c in cfgs]
    fitted = _fit_and_search(run, counts)
    signal = None
    for c, k in zip(cfgs, counts):
        restore_layer_states(run.layers, fitted.states)
        report = _configure(replace(run, cfg=c), fitted, k, signal)
        signal = report.get("signal")
        model.train(was_training)
        yield report


def _start(model: nn.Module, batches: Sequence[Any], host: Host, cfg: LatteConfig) -> CalibrationRun:
    """Checks the inputs, puts every layer exact in the chosen variant, and splits the images."""
    layers = find_latte_layers(model)
    if not layers:
        raise ValueError("the model has no LATTE layers: swap the candidate attention modules in first")
    if float(host.all_reduce(torch.tensor([float(len(batches))], dtype=torch.float64))[0]) == 0:
        raise ValueError("empty calibration set: the calibration loader gave no batch; give num_images >= 1")
    for layer in layers.values():
        layer.variant = cfg.variant
        layer.mode = "exact"
    model.eval()
    rank, world = host.shard
    positions = list(host.positions) if host.positions is not None else [i * world + rank for i in range(len(batches))]
    split = split_calibration(list(batches), positions[: len(batches)], cfg, host.all_reduce)
    fold_of = fold_assignment(split, cfg, host.all_reduce, host.shard)
    return CalibrationRun(layers, cfg, split, fold_of, host, judge=configuration_judge(cfg, host.forward, host.fidelity),
                          fidelity=host.fidelity or RawDistortion(host.forward, relative=True))


def _fit_and_search(run: CalibrationRun, counts: Sequence[int]) -> _Fitted:
    """Steps 1-3, shared by every share: record and fit every layer, then score and search each
    half for every count the shares need (every count with ``target``; none when choosing for
    speed, which first measures the cost model and refuses an unreachable ``speedup``)."""
    cost = _shared_costs(run) if run.cfg.for_speed else None
    if cost is not None:
        check_reachable(cost, run.cfg.speedup)
    fits, corrections, targets, menus = _calibrate_layers(run, cost)
    ks = [] if cost is not None else list(range(1, len(run.layers) + 1)) if run.cfg.target is not None else sorted(set(counts))
    halves = [_search_half(run, i, corrections, ks) for i in range(len(run.split.halves))]
    return _Fitted(fits, corrections, targets, halves, ks, layer_states(run.layers), menus, cost)


def _shared_costs(run: CalibrationRun) -> CostModel:
    """The cost model at this rank's first calibration batch, averaged across ranks (every rank
    must choose the same assignment); or the user's ``cost_model`` file."""
    if run.cfg.cost_model:
        return load_cost_model(run.cfg.cost_model, list(run.layers))
    knobs = {"block": run.cfg.piecewise_block, "order": run.cfg.piecewise_order, "rest": run.cfg.piecewise_rest}
    cost = measure_costs(run.layers, run.split.used[0][1], whole_network(run.forward), knobs)
    keys = [(n, m) for n, c in cost.layers.items() for m in c]
    world = float(run.shard[1])
    flat = run.reduce(torch.tensor([cost.exact_ms, cost.scale] + [cost.layers[n][m] for n, m in keys],
                                   dtype=torch.float64)) / world
    layers: dict = {n: {} for n in cost.layers}
    for (n, m), v in zip(keys, flat[2:].tolist()):
        layers[n][m] = v
    run.log(f"[latte] cost model: exact forward {float(flat[0]):.1f} ms, attention "
            + ", ".join(f"{n} {c['exact']:.2f} ms" for n, c in layers.items()))
    if cost.anchor:
        run.log(f"[latte] cost model anchored end to end: the fastest assignment measured "
                f"{cost.anchor['speedup']:.2f}x against {cost.anchor['unscaled_speedup']:.2f}x from the layers "
                f"timed alone; savings scaled by {float(flat[1]):.3f}")
    return replace(cost, exact_ms=float(flat[0]), scale=float(flat[1]), layers=layers)


def _calibrate_layers(run: CalibrationRun, cost: Optional[CostModel]) -> tuple[dict, CorrectionTable, Optional[dict], dict]:
    """Records and fits every layer (one group, or layer by layer with ``sequential``); with a
    cost model, in every mode it times too.

    Returns:
        ``(fits, corrections, exact targets, {layer: {mode: ModeFit}})`` (:func:`_fit_layers`,
        :func:`_exact_targets`; no targets with ``sequential``, whose records are not the exact model's).
    """
    fits: dict[str, dict] = {}
    menus: dict[str, dict] = {}
    corrections: dict[str, dict] = {r: {} for r in run.rules}
    targets = None
    names = list(run.layers)
    for group in ([[n] for n in names] if run.cfg.sequential else [names]):
        recs = record_layers(run, group, f"recording {group[0]}" if run.cfg.sequential else "recording")
        group_fits, group_corrections = _fit_layers(run, group, recs, cost, menus)
        fits.update(group_fits)
        for rule in run.rules:
            corrections[rule].update(group_corrections[rule])
        if run.cfg.sequential:
            run.layers[group[0]].mode = "linear"
        else:
            targets = _exact_targets(recs)
    return fits, CorrectionTable(corrections), targets, menus


def _fit_layers(run: CalibrationRun, group: list[str], recs: dict, cost: Optional[CostModel] = None,
                menus: Optional[dict] = None) -> tuple[dict, dict]:
    """Fits each layer of ``group`` on its ``fit`` records (knobs on ``choose``, errors on ``report``);
    with ``cost``, also in each of the layer's timed modes (into ``menus``).

    Returns:
        ``({layer: report entry}, {rule: {layer: FittedCorrection}})``; the second feeds the
        cross-fitted judge.
    """
    cfg, fits, corrections = run.cfg, {}, {r: {} for r in run.rules}
    # every rank holds every item (share_items): no all-reduce, so the sums run in one fixed order
    opts = FitOptions(steps=cfg.steps, lr=cfg.lr, correction=cfg.correction, per_head=cfg.per_head,
                      refit_regs=tuple(cfg.refit_reg), fold_of=run.fold_of, rules=run.rules, kernel=cfg.kernel,
                      piecewise_top=cfg.piecewise_top, piecewise_block=cfg.piecewise_block,
                      piecewise_rest=cfg.piecewise_rest, piecewise_order=cfg.piecewise_order)
    for n in group:
        layer = run.layers[n]
        records = LayerRecords(*(recs[role][n].items for role in ROLES))
        res = fit_records(layer, records, opts)
        if cost is not None and menus is not None:
            menus[n] = fit_modes(layer, records, opts, [m for m in cost.layers[n] if m != "exact"])
        fits[n] = fit_entry(res)
        for rule in run.rules:
            corrections[rule][n] = res.rules[rule]
        held = "" if res.heldout_mse is None else f", held-out {res.heldout_mse:.3e}"
        if res.kernel and res.kernel["kernel"] == "piecewise":
            held += f", piecewise top {res.kernel['top']} gamma {res.kernel['gamma']}"
        run.log(f"[latte] fitted {n}: alpha={layer.alpha:.4f} rho={float(layer.log_rho.exp().mean()):.4g} "
                f"mse {res.initial_mse:.3e} -> {res.final_mse:.3e}{held} (steps {res.steps}, {res.correction})")
    return fits, corrections


def _exact_targets(recs: dict) -> dict[str, dict[int, Tensor]]:
    """``{layer: {item key: exact attention output}}`` of every role's records."""
    return {n: {it.key: it.target for role in ROLES for it in recs[role][n].items} for n in recs["fit"]}


def _search_half(run: CalibrationRun, i: int, corrections: CorrectionTable, ks: Sequence[int]) -> HalfSearch:
    """Scores half ``i`` and runs every selection method on it (cross-fitted, the user's rule)."""
    stats, tokens = score_stats(run, run.split.halves[i], corrections[run.cfg.correction])
    searcher = CrossFitJudge(run.layers, run.split.greedy[i], run.fold_of, run.reduce)
    sets, traces = _search(run, [searcher], scores(stats, run.cfg.lam), ks, corrections, run.methods if ks else ("score",))
    return HalfSearch(CrossFitJudge(run.layers, run.split.halves[i], run.fold_of, run.reduce), searcher, stats, tokens,
                      sets, traces)


def _search(run: CalibrationRun, searchers: list, sens: dict, ks: Sequence[int], corrections: CorrectionTable,
            methods: Sequence[str]):
    """``candidate_sets`` with every set measured by the cross-fitted raw-output MSE (slot by slot,
    or matched by box: ``search``) on the searchers' images together (each searcher remembers what
    it measured)."""
    mse, rule = search_measure(run.cfg, run.forward), run.cfg.correction
    return candidate_sets(methods, run.layers, sens, ks,
                          lambda s: merged([j(mse, corrections[rule], rule)(s) for j in searchers], mse).loss)


def _configure(run: CalibrationRun, fitted: _Fitted, k: int, signal: Optional[dict]) -> dict:
    """One share's steps (``k`` layers, or ``target``'s count), from choosing the configuration
    to the report; nothing it does changes what another share reads."""
    if run.cfg.for_speed:
        return _configure_speed(run, fitted, signal)
    cfg, halves = run.cfg, fitted.halves
    ks = fitted.ks if cfg.target is not None else [k]
    chosen, how = _select_configuration(run, fitted, ks, k)
    k = chosen.k if cfg.target is not None else k
    chosen, trace = _final_set(run, chosen, fitted, how)
    if cfg.target is None:  # the searches may have run past k for another share
        trace = trace_up_to(chosen.method, trace, k, len(run.layers))
    corrections, compensated = fitted.corrections, {}
    if chosen.layers and fitted.targets is not None and cfg.compensate != "never":
        chosen, corrections, compensated, how["compensation"] = _choose_compensation(run, chosen, fitted)
    applied = _install_corrections(run, chosen, corrections)
    held = _heldout_figures(run, chosen, corrections, halves)
    sens = scores(summed_stats(h.stats for h in halves), cfg.lam)
    _apply_selection(run, chosen.layers, sens)
    if signal is None:
        signal = attention_signal(run.layers, [b for _, b in run.split.used], run.forward, run.reduce) if cfg.signal else {}
    fits = {n: {**f, **({"compensated": compensated[n]} if n in compensated else {}),
                **({"applied": applied[n]} if n in applied else {})} for n, f in fitted.fits.items()}
    share = ShareResult(k, chosen.layers, sens, fits, trace, sum(h.tokens for h in halves), held.get("raw_mse"), signal)
    report = build_report(run, share)
    report["selection"].update(how, configuration=chosen.name, heldout=held)
    return report


def _configure_speed(run: CalibrationRun, fitted: _Fitted, signal: Optional[dict]) -> dict:
    """The speed search's steps (:func:`~.speed.speed_front`), then the same install, held-out
    figures, report and a measured end-to-end speed-up beside the predicted one. No error
    compensation: its refit is a layer set's, not a mode assignment's."""
    choice = speed_front(run, fitted.halves, fitted.menus, fitted.cost)
    assignment = dict(choice.chosen.assignment)
    chosen = Configuration("speed", "speed", list(assignment), k=len(assignment))
    corrections = fitted.corrections.with_rule("speed", {n: fitted.menus[n][m].correction for n, m in assignment.items()})
    applied = install_assignment(run.layers, fitted.menus, assignment)
    held = _heldout_figures(run, chosen, corrections, fitted.halves)
    sens = scores(summed_stats(h.stats for h in fitted.halves), run.cfg.lam)
    _apply_selection(run, chosen.layers, sens)
    batch = run.split.used[0][1]
    timed = whole_network(run.forward)
    measured = measured_speedup(lambda: timed(batch), lambda on: set_modes(run.layers, chosen.layers if on else []))
    if signal is None:
        signal = attention_signal(run.layers, [b for _, b in run.split.used], run.forward, run.reduce) if run.cfg.signal else {}
        _apply_selection(run, chosen.layers, sens)
    fits = {n: {**f, **({"applied": applied[n], "kernel": fitted.menus[n][assignment[n]].entry()["kernel"],
                         "mode": assignment[n]} if n in applied else {}),
                "modes": {m: mf.entry() for m, mf in fitted.menus.get(n, {}).items()}} for n, f in fitted.fits.items()}
    share = ShareResult(len(assignment), chosen.layers, sens, fits, [], sum(h.tokens for h in fitted.halves),
                        held.get("raw_mse"), signal)
    report = build_report(run, share)
    report["selection"].update(chosen="speed", configuration="speed", heldout=held)
    report["speed"] = {"cost": fitted.cost.entry(), **choice.entry(), "assignment": assignment,
                       "predicted_speedup": choice.chosen.speedup, "measured_speedup": measured["speedup"],
                       "measured": measured, "speedup": run.cfg.speedup, "target": run.cfg.target}
    run.log(f"[latte] speed-up at this input size: predicted {choice.chosen.speedup:.2f}x, measured "
            f"{measured['speedup']:.2f}x (exact {measured['exact_ms']:.1f} ms, hybrid {measured['hybrid_ms']:.1f} ms)")
    return report


def _select_configuration(run: CalibrationRun, fitted: _Fitted, ks: Sequence[int], k: int) -> tuple[Configuration, dict]:
    """The configuration to apply (its layers are set by :func:`_final_set`) and how it was
    chosen (``docs/method.md#configurations``): every (method, rule) pair judged across the
    halves, and :func:`choose_configuration` keeps the reference (``run.reference``) unless
    another gains more than its noise. With ``target``, the count is the largest where some method's pair with
    the user's rule is within the target, and only pairs within it compete."""
    cfg, pairs = run.cfg, [(m, r) for m in run.methods for r in run.rules]
    halves, corrections = fitted.halves, fitted.corrections
    if not ks or max(ks) == 0:
        return Configuration(run.methods[0], cfg.correction, []), {}
    measure, info = run.judge, {}
    if cfg.target is not None:
        measure = run.fidelity
        k, info = target_count(run.methods, ks, float(cfg.target),
                               lambda m, j: across_halves(halves, run.fidelity, corrections, cfg.correction, m, j))
        info["target"]["measure"] = run.fidelity.name
    if len(pairs) == 1 or k == 0:
        return Configuration(pairs[0][0], pairs[0][1], [], k=k), {"chosen": pairs[0][0], **info}
    verdicts = {configuration_name(m, r): across_halves(halves, measure, corrections, r, m, k) for m, r in pairs}
    if cfg.target is not None:
        verdicts = {n: v for n, v in verdicts.items() if v.loss <= float(cfg.target)}
    reference = run.reference if run.reference in verdicts else next(iter(verdicts))
    name, comparison = choose_configuration(verdicts, reference=reference, moderated=cfg.reference == "evidence")
    method, rule = next((m, r) for m, r in pairs if configuration_name(m, r) == name)
    comparison["layers"] = {configuration_name(m, r): [h.sets[(m, k)] for h in halves] for m, r in pairs}
    run.log(f"[latte] configuration: {name} (cross-fitted {measure.name}: "
            + ", ".join(f"{n} {v:.4e}" for n, v in comparison["losses"].items()) + ")")
    return Configuration(method, rule, [], k=k), {"chosen": method, "comparison": comparison, "measure": measure.name,
                                                  "search_measure": search_measure(cfg, run.forward).name, **info}


def _final_set(run: CalibrationRun, chosen: Configuration, fitted: _Fitted, how: dict) -> tuple:
    """The chosen configuration's linear set: with one half, its search's set; a ``score`` set
    from the score summed over both halves; a search's set where both halves' searches agree,
    else the search run again on every search image (always, with ``final_set='pooled'``: a half's
    search saw half as many images); with ``final_set='confirm'`` or ``'pooled'`` that set and
    each half's are judged on the images no search saw (:func:`~.judge.confirmed_set`). Returns
    ``(configuration, trace)``."""
    m, k, halves = chosen.method, chosen.k, fitted.halves
    if not k:
        return chosen, []
    if len(halves) == 1:
        return replace(chosen, layers=halves[0].sets[(m, k)]), halves[0].traces.get(m, [])
    if m == "score":
        layers, trace = select_by_score(scores(summed_stats(h.stats for h in halves), run.cfg.lam), k), []
        return replace(chosen, layers=[n for n in run.layers if n in layers]), trace
    found = [(h.sets[(m, k)], h.traces.get(m, [])) for h in halves]
    agree = set(found[0][0]) == set(found[1][0])
    if agree and run.cfg.final_set != "pooled":
        layers, trace = found[0]
    else:
        sets, traces = _search(run, [h.searcher for h in halves], {}, [k], fitted.corrections, (m,))
        layers, trace = sets[(m, k)], traces.get(m, [])
        how["searched_again"] = ("final_set='pooled': searched again on every search image" if agree else
                                 "the halves' searches disagreed: searched again on every search image")
        if run.cfg.final_set in ("confirm", "pooled"):
            layers, trace, how["confirmed"] = confirmed_set(run, fitted.corrections[chosen.rule], [(layers, trace), *found])
    return replace(chosen, layers=[n for n in run.layers if n in layers]), trace


def _choose_compensation(run: CalibrationRun, chosen: Configuration,
                         fitted: _Fitted) -> tuple[Configuration, CorrectionTable, dict, dict]:
    """Compensates the chosen layers (:func:`~.compensate.compensate_layers`) and, with
    ``compensate='auto'``, keeps it only if the hybrid's cross-fitted ``run.judge`` loss on every
    fit and choice image is clearly lower (:func:`_compensation_gain`) and, with ``target``, its fidelity
    loss is still within the target (``docs/method.md#compensation``).

    Returns:
        ``(configuration, corrections with <rule>+compensation added, {layer: compensated report
        entry}, how it was decided)``.
    """
    judge, halves = run.judge, fitted.halves
    compensated = replace(chosen, compensated=True)
    key = compensated.corrections_key
    plain = on_every_image(halves, judge, fitted.corrections[chosen.rule], chosen.rule, chosen.layers)
    comp_fits, comp = compensate_layers(run, chosen, fitted.targets)
    corrections = fitted.corrections.with_rule(key, {**fitted.corrections[chosen.rule], **comp})
    after = on_every_image(halves, judge, corrections[key], key, chosen.layers)
    before, gain = plain.loss, _compensation_gain(run.cfg, plain, after)
    keep = run.cfg.compensate == "always" or gain["clear"]
    info = {"crossfit_distortion": {"plain": before, "compensated": after.loss}, "measure": judge.name, **gain}
    if keep and run.cfg.target is not None and run.cfg.compensate == "auto":
        info["target_loss"] = on_every_image(halves, run.fidelity, corrections[key], key, chosen.layers).loss
        keep = info["target_loss"] <= float(run.cfg.target)  # re-judged: dropped if it breaks the budget
    run.log(f"[latte] error compensation: cross-fitted {judge.name} {before:.4e} -> {after.loss:.4e}: "
            f"{'kept' if keep else 'not kept'}")
    return (compensated if keep else chosen), corrections, comp_fits, {**info, "kept": keep}


def _compensation_gain(cfg: LatteConfig, plain: Verdict, compensated: Verdict) -> dict:
    """Whether compensation clearly lowers the judge's loss: with ``reference='evidence'``, by
    the configuration choice's noise rule (paired per-image log gain above ``NOISE_Z`` standard
    errors); with ``reference='paper'``, by any margin (the earlier rule)."""
    if cfg.reference == "paper":
        return {"clear": compensated.loss < plain.loss}
    gain, se = paired_gain(plain.per_image, compensated.per_image)
    return {"clear": bool(gain > NOISE_Z * se), "gain": gain, "standard_error": se, "z": NOISE_Z}


def _install_corrections(run: CalibrationRun, chosen: Configuration, corrections: CorrectionTable) -> dict[str, str]:
    """Gives every layer the chosen configuration's correction, fitted on every fit and choice
    image; returns the candidate each layer took (``{layer: name}``)."""
    applied = {}
    for n, corr in corrections[chosen.corrections_key].items():
        set_correction(run.layers[n], corr.kind, corr.weights)
        applied[n] = corr.name
    return applied


def _heldout_figures(run: CalibrationRun, chosen: Configuration, corrections: CorrectionTable, halves: list) -> dict:
    """The chosen configuration's raw-output MSE and fidelity loss on the report images when
    there are any (nothing was fitted on or chosen by them), else its raw-output MSE on every
    fit and choice image, cross-fitted (no image measured with a correction fitted on it; the
    images did choose the configuration and its set: ``docs/method.md#report``), and the
    fidelity loss where ``target`` already measured it. Empty without linear layers."""
    if not chosen.layers:
        return {}
    fidelity: Measure = run.fidelity
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


def _apply_selection(run: CalibrationRun, chosen: list[str], sens: dict[str, float]) -> None:
    """Puts the chosen layers in ``cfg.mode`` (the rest exact) and logs each layer's state."""
    set_modes(run.layers, chosen, run.cfg.mode)
    for layer in run.layers.values():
        layer.threshold.fill_(int(run.cfg.threshold))
    for n in run.layers:
        run.log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")
