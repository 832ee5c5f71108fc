"""Whole configurations as candidates, and the noise rule that chooses among them
(``docs/method.md#configurations``).

A configuration is a selection method (which layers go linear) with a correction rule (how
each linear layer's output is corrected), optionally followed by error compensation. Every
candidate is judged end to end by :class:`~latte_plugin.core.judge.CrossFitJudge` on the same
images, image by image, and :func:`choose_configuration` moves away from the reference (the
first candidate: the paper's protocol when it is among them) only when the gain is larger
than its noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .judge import Verdict

__all__ = ["NOISE_Z", "Configuration", "configuration_name", "paired_gain", "naive_paired_gain",
           "choose_configuration", "target_count"]

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
    eps = _floor(ref.tolist())
    d = torch.log((ref.double() + eps) / (cand.double() + eps))
    if d.numel() < 2:
        return (float(d.sum()), math.inf)
    return float(d.mean()), float(d.std(unbiased=True) / math.sqrt(d.numel()))


def choose_configuration(verdicts: dict[str, Verdict], z: float = NOISE_Z) -> tuple[str, dict]:
    """The configuration to keep, by the noise rule.

    The reference is the first candidate in ``verdicts``; the best is the one of lowest loss
    (earlier wins ties). The best replaces the reference only if its paired per-image gain
    (:func:`paired_gain`, log scale) exceeds ``z`` standard errors.

    Args:
        verdicts: ``{configuration name: Verdict}`` on the same judging images, reference first.
        z: the noise rule's multiple of the standard error.

    Returns:
        ``(chosen name, {"reference", "best", "gain", "standard_error", "z", "losses"})``.
    """
    names = list(verdicts)
    reference = names[0]
    best = min(names, key=lambda n: (_finite(verdicts[n].loss), names.index(n)))
    gain, se = paired_gain(verdicts[reference].per_image, verdicts[best].per_image)
    chosen = best if best != reference and gain > z * se and math.isfinite(se) else reference
    return chosen, {"reference": reference, "best": best, "gain": gain, "standard_error": se, "z": z,
                    "losses": {n: v.loss for n, v in verdicts.items()}, "images": int(verdicts[reference].per_image.numel())}


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
