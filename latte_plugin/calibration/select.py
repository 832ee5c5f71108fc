"""Which layers go linear (``docs/method.md#selection``) and which whole configuration is kept
(``docs/method.md#configurations``).

* The paper's per-layer sensitivity score (:func:`score_stats`, :func:`scores`) and the greedy /
  backward searches that measure whole sets (:func:`candidate_sets`);
* whole configurations as candidates (a selection method with a correction rule, optionally
  compensated), every one judged end to end by
  :class:`~latte_plugin.calibration.judge.CrossFitJudge` on the same images, image by image;
  :func:`choose_configuration` moves away from the reference (greedy with refit by default, chosen
  from the design calibrations' judge losses; the paper's protocol under ``reference='paper'``)
  only when the gain is larger than its noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..nn.install import set_modes
from .context import CalibrationRun
from .corrections import FittedCorrection, set_correction
from .judge import Verdict
from .taps import output_taps

__all__ = ["naive_sensitivity_score", "SensitivityStats", "scores", "select_by_score", "greedy_select",
           "backward_select", "candidate_sets", "LastOutput", "summed_stats", "trace_up_to", "score_stats",
           "NOISE_Z", "Configuration", "configuration_name", "naive_paired_gain", "paired_gain",
           "choose_configuration", "target_count", "moderated_gains", "naive_moderated_gains"]


def naive_sensitivity_score(a: Tensor, a_tilde: Tensor, lam: float = 10.0, eps: float = 1e-8) -> float:
    """``I = (1 - mean_i cos(a_i, a~_i)) + lam * ||A - A~||_F^2 / (T d)`` over rows ``a_i``.

    Args:
        a: original activations ``(..., d)``, all leading dims are tokens (B*N rows).
        a_tilde: linearized activations, same shape.
    """
    a2, t2 = a.reshape(-1, a.shape[-1]).double(), a_tilde.reshape(-1, a.shape[-1]).double()
    cos = (a2 * t2).sum(-1) / (a2.norm(dim=-1) * t2.norm(dim=-1) + eps)
    mse = ((a2 - t2) ** 2).sum() / a2.numel()
    return float((1 - cos.mean()) + lam * mse)


class SensitivityStats:
    """Streaming sums behind the sensitivity score, so memory does not grow with images.

    ``update`` takes one batch's activations; ``sums`` is a float64 tensor
    ``[sum cos, rows, sum sq err, elements]`` that can be all-reduced across ranks.
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.sums = torch.zeros(4, dtype=torch.float64)

    def update(self, a: Tensor, a_tilde: Tensor, valid: Optional[Tensor] = None) -> None:
        """Adds a batch. ``a``/``a_tilde``: ``(B, N, d)``; ``valid``: ``(B, N)`` bool of real tokens."""
        a2, t2 = a.reshape(-1, a.shape[-1]).double(), a_tilde.reshape(-1, a.shape[-1]).double()
        if valid is not None:
            keep = valid.reshape(-1)
            a2, t2 = a2[keep], t2[keep]
        cos = (a2 * t2).sum(-1) / (a2.norm(dim=-1) * t2.norm(dim=-1) + self.eps)
        self.sums += torch.stack(
            [cos.sum(), torch.tensor(float(a2.shape[0]), dtype=torch.float64), ((a2 - t2) ** 2).sum(),
             torch.tensor(float(a2.numel()), dtype=torch.float64)]
        ).cpu()

    def score(self, lam: float = 10.0) -> float:
        s = self.sums
        if s[1] == 0:
            raise ValueError("no tokens were scored; is the calibration set empty?")
        return float((1 - s[0] / s[1]) + lam * s[2] / s[3])


def scores(stats: dict[str, SensitivityStats], lam: float = 10.0) -> dict[str, float]:
    """``{layer: the paper's score}`` from each layer's summed statistics."""
    return {n: st.score(lam) for n, st in stats.items()}


def select_by_score(scores: dict[str, float], k: int) -> list[str]:
    """The ``k`` least sensitive layers (ascending score; ties by name for determinism)."""
    order = sorted(scores, key=lambda n: (scores[n], n))
    return order[:k]


def greedy_select(
    candidates: Sequence[str], k: int, distortion: Callable[[list[str]], float]
) -> tuple[list[str], list[dict]]:
    """Global greedy selection: add one layer at a time, the one whose linearization hurts the final output least.

    Args:
        candidates: layer names.
        k: layers to linearize.
        distortion: maps a set of linear layers to the final-output error (lower is better).

    Returns:
        The chosen layers in the order they were added, and a trace ``[{step, added, distortion}]``.
    """
    chosen: list[str] = []
    trace = []
    for step in range(k):
        best, best_d = None, math.inf
        for name in candidates:
            if name in chosen:
                continue
            d = distortion(chosen + [name])
            if d < best_d or (d == best_d and best is not None and name < best):
                best, best_d = name, d
        chosen.append(best)
        trace.append({"step": step + 1, "added": best, "distortion": best_d})
    return chosen, trace


def backward_select(
    candidates: Sequence[str], k: int, distortion: Callable[[list[str]], float]
) -> tuple[list[str], list[dict]]:
    """Global backward elimination: start with every candidate linear and restore to exact,
    one at a time, the layer whose restoration lowers the final-output error most.

    Unlike :func:`greedy_select`, every decision is made with the *other* linear layers
    present, so interactions among the layers that end up linear are seen from the start.
    Costs ``sum_{j=k+1..L} j`` distortion calls (fewer than greedy when ``k > L/2``).

    Returns:
        The chosen layers (model order), and a trace ``[{step, restored, distortion}]``.
    """
    linear = list(candidates)
    trace = [{"step": 0, "restored": None, "distortion": distortion(list(linear))}] if k < len(linear) else []
    step = 0
    while len(linear) > k:
        step += 1
        best, best_d = None, math.inf
        for name in linear:
            d = distortion([n for n in linear if n != name])
            if d < best_d or (d == best_d and best is not None and name < best):
                best, best_d = name, d
        linear.remove(best)
        trace.append({"step": step, "restored": best, "distortion": best_d})
    return linear, trace


def candidate_sets(methods: Sequence[str], layers: Sequence[str], sens: dict[str, float],
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


class LastOutput:
    """An output tap (:func:`~latte_plugin.calibration.taps.output_taps`) that keeps the last output it saw in ``store[name]``."""

    def __init__(self, store: dict, name: str) -> None:
        self.store, self.name = store, name

    def __call__(self, out: Tensor) -> None:
        self.store[self.name] = out.detach()


def summed_stats(stats: Iterable[dict]) -> dict:
    """Score statistics of several image sets, added up (they are sums)."""
    total: dict = {}
    for part in stats:
        for n, st in part.items():
            if n not in total:
                total[n] = SensitivityStats()
                total[n].sums = st.sums.clone()
            else:
                total[n].sums = total[n].sums + st.sums
    return total


def trace_up_to(method: str, trace: list, k: int, num_layers: int) -> list:
    """The part of a search's trace a search for ``k`` layers alone records: greedy's first ``k``
    additions; backward's start and its restorations down to ``k`` linear (none when ``k`` is all)."""
    if method == "greedy":
        return [t for t in trace if t["step"] <= k]
    if method == "backward":
        return [t for t in trace if t["step"] <= num_layers - k] if k < num_layers else []
    return trace


def score_stats(run: CalibrationRun, batches: list,
                corrections: Mapping[str, FittedCorrection]) -> tuple[dict, Tensor]:
    """The paper's per-layer score statistics (exact vs fully linear outputs, streamed; summed
    across ranks, so they add up over image sets) and ``(token rows, images)`` per layer, over
    ``batches`` (``docs/method.md#selection``); each image's linear pass uses the corrections
    fitted without its fold."""
    layers, names = run.layers, list(run.layers)
    stats = {n: SensitivityStats() for n in names}
    tokens = torch.zeros(len(names), 2, dtype=torch.float64)
    captured: dict[str, Tensor] = {}
    try:
        with output_taps(layers, {n: LastOutput(captured, n) for n in names}):
            _score_batches(run, batches, corrections, captured, (stats, tokens))
    finally:
        for n in names:
            set_correction(layers[n], corrections[n].kind, corrections[n].weights)
    for n in names:
        stats[n].sums = run.reduce(stats[n].sums)
    return stats, run.reduce(tokens)


def _score_batches(run: CalibrationRun, batches: list, corrections: Mapping[str, FittedCorrection],
                   captured: dict, into: tuple[dict, Tensor]) -> None:
    """Adds each batch's exact and fully linear layer outputs (``captured`` by the taps) to the
    statistics and token counts ``into``."""
    layers, names = run.layers, list(run.layers)
    stats, tokens = into
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


#: How many standard errors of the paired per-image difference a candidate must gain over the
#: reference before it is chosen instead (about a one-sided 2% test under normality).
NOISE_Z = 2.0


@dataclass
class Configuration:
    """One candidate: the layers a selection method makes linear and the correction rule they use.

    Attributes:
        method: ``score``, ``greedy`` or ``backward``; rule: ``sigma``, ``refit``, ``auto``,
            ``none``; layers: the linear layers (model order); compensated: error compensation
            applied on top; k: how many layers go linear.
    """

    method: str
    rule: str
    layers: list
    compensated: bool = False
    k: int = 0

    @property
    def name(self) -> str:
        return configuration_name(self.method, self.rule, self.compensated)

    @property
    def corrections_key(self) -> str:
        """The key of its corrections in the flow's ``{key: {layer: FittedCorrection}}``."""
        return self.rule + ("+compensation" if self.compensated else "")


def configuration_name(method: str, rule: str, compensated: bool = False) -> str:
    """``greedy+sigma``, ``score+auto+compensation``, ..."""
    return f"{method}+{rule}" + ("+compensation" if compensated else "")


def _floor(ref: Sequence[float]) -> float:
    """What is added to every loss before the logarithm: a thousandth of the reference's mean
    per-image loss (so an image that both leave unchanged adds no evidence either way)."""
    return 1e-3 * sum(ref) / max(1, len(ref)) + 1e-12


def naive_paired_gain(ref: Sequence[float], cand: Sequence[float]) -> tuple[float, float]:
    """Reference for :func:`paired_gain`, in plain Python."""
    eps = _floor(list(ref))
    d = [math.log((r + eps) / (c + eps)) for r, c in zip(ref, cand)]
    n = len(d)
    if n < 2:
        return (d[0] if d else 0.0), math.inf
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def paired_gain(ref: Tensor, cand: Tensor) -> tuple[float, float]:
    """The candidate's paired per-image gain over the reference, on a log scale, and its standard error.

    Output errors spread over orders of magnitude from image to image, and a configuration
    changes them by factors, so each image contributes ``log(ref / cand)`` (both floored by
    :func:`_floor`): one heavy image cannot decide alone, and ``exp(gain)`` is the typical factor.

    Args:
        ref, cand: ``(images,)`` per-image losses on the same images, in the same order.

    Returns:
        ``(mean log ratio, its standard error)``; the error is infinite with fewer than two
        images (no noise estimate: nothing can beat the reference).
    """
    d = _log_ratios(ref, cand)
    if d.numel() < 2:
        return (float(d.sum()), math.inf)
    return float(d.mean()), float(d.std(unbiased=True) / math.sqrt(d.numel()))


def _log_ratios(ref: Tensor, cand: Tensor) -> Tensor:
    """``log(ref / cand)`` per image, both floored by :func:`_floor` of the reference: ``(images,)``."""
    eps = _floor(ref.tolist())
    return torch.log((ref.double() + eps) / (cand.double() + eps))


def naive_moderated_gains(ref: Sequence[float], cands: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
    """Reference for :func:`moderated_gains`, in plain Python."""
    eps = _floor(list(ref))
    diffs = {c: [math.log((r + eps) / (x + eps)) for r, x in zip(ref, v)] for c, v in cands.items()}
    n = len(ref)
    if n < 2:
        return {c: ((d[0] if d else 0.0), math.inf) for c, d in diffs.items()}
    var = {c: sum((x - sum(d) / n) ** 2 for x in d) / (n - 1) for c, d in diffs.items()}
    informative = [var[c] for c, d in diffs.items() if any(x != 0.0 for x in d)]
    pooled = sum(informative) / len(informative) if informative else None
    return {c: (sum(d) / n, math.sqrt((var[c] if pooled is None else (var[c] + pooled) / 2) / n))
            for c, d in diffs.items()}


def moderated_gains(ref: Tensor, cands: Mapping[str, Tensor]) -> dict[str, tuple[float, float]]:
    """Every candidate's paired per-image log gain over the reference (as :func:`paired_gain`),
    with a standard error shrunk halfway toward the other candidates'.

    With 8 images a sample variance has 7 degrees of freedom: one image can inflate or deflate
    it by a factor of several. The candidates are judged on the same images against the same
    reference, so their per-image variances estimate a shared noise level. Each candidate's
    variance is averaged with the mean variance of every candidate that differs from the
    reference on some image (those identical to it carry no noise evidence): the moderated
    variance of empirical-Bayes tests, with the prior weighted as much as the candidate's own
    images. With many images the two agree and the rule is the plain one.

    Args:
        ref: ``(images,)`` the reference's per-image losses.
        cands: ``{name: (images,)}`` each candidate's per-image losses on the same images.

    Returns:
        ``{name: (mean log ratio, moderated standard error)}``; the error is infinite with
        fewer than two images.
    """
    diffs = {c: _log_ratios(ref, v) for c, v in cands.items()}
    n = ref.numel()
    if n < 2:
        return {c: (float(d.sum()), math.inf) for c, d in diffs.items()}
    var = {c: float(d.var(unbiased=True)) for c, d in diffs.items()}
    informative = [var[c] for c, d in diffs.items() if bool((d != 0).any())]
    pooled = sum(informative) / len(informative) if informative else None
    return {c: (float(d.mean()), math.sqrt((var[c] if pooled is None else (var[c] + pooled) / 2) / n))
            for c, d in diffs.items()}


def choose_configuration(verdicts: dict[str, Verdict], z: float = NOISE_Z, reference: Optional[str] = None,
                         moderated: bool = False) -> tuple[str, dict]:
    """The configuration to keep, by the noise rule (``docs/method.md#configurations``).

    The best is the candidate of lowest loss (the reference wins ties, then the earlier). The
    best replaces the reference only if its paired per-image log gain exceeds ``z`` standard
    errors: the plain one of :func:`paired_gain`, or with ``moderated`` the one of
    :func:`moderated_gains` (shrunk toward the other candidates').

    Args:
        verdicts: ``{configuration name: Verdict}`` on the same judging images.
        z: the noise rule's multiple of the standard error.
        reference: the name to keep unless another clearly wins; ``None``: the first.
        moderated: shrink the standard error toward the other candidates'.

    Returns:
        ``(chosen name, {"reference", "best", "gain", "standard_error", "z", "losses", "images",
        "noise"})``.
    """
    reference = reference if reference is not None else next(iter(verdicts))
    if reference not in verdicts:
        raise ValueError(f"the reference {reference!r} is not among the candidates {sorted(verdicts)}")
    names = [reference] + [n for n in verdicts if n != reference]
    best = min(names, key=lambda n: (_finite(verdicts[n].loss), names.index(n)))
    ref = verdicts[reference].per_image
    if moderated:
        gain, se = moderated_gains(ref, {n: verdicts[n].per_image for n in names[1:]}).get(best, (0.0, math.inf))
    else:
        gain, se = paired_gain(ref, verdicts[best].per_image)
    chosen = best if best != reference and gain > z * se and math.isfinite(se) else reference
    return chosen, {"reference": reference, "best": best, "gain": gain, "standard_error": se, "z": z,
                    "noise": "moderated" if moderated else "plain",
                    "losses": {n: v.loss for n, v in verdicts.items()}, "images": int(ref.numel())}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def target_count(methods: Sequence[str], ks: Sequence[int], target: float,
                 verdict: Callable[[str, int], Any]) -> tuple[int, dict]:
    """From the most layers down: the first count where some method's set is within ``target``.

    Args:
        methods: the selection methods; ks: the counts to try; target: the fidelity budget;
        verdict: ``(method, count) -> Verdict`` (remembered: methods may share sets).

    Returns:
        ``(count, {"target": {target, k, losses: {k: {method: loss}}}})``; count 0 when none fits.
    """
    losses: dict[int, dict[str, float]] = {}
    for k in sorted(ks, reverse=True):
        losses[k] = {m: verdict(m, k).loss for m in methods}
        if min(losses[k].values()) <= target:
            return k, {"target": {"target": target, "k": k, "losses": losses}}
    return 0, {"target": {"target": target, "k": 0, "losses": losses}}
