"""Sensitivity-aware layer selection (``docs/method.md#selection``)."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from .calibration import set_correction
from .layer import set_modes

__all__ = ["backward_select", "candidate_sets", "LastOutput", "scores", "score_stats", "summed_stats", "trace_up_to",
    "naive_sensitivity_score",
    "SensitivityStats",
    "num_linear_layers",
    "select_by_score",
    "greedy_select",
]


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


def num_linear_layers(num_candidates: int, ratio: Optional[float] = None, count: Optional[int] = None) -> int:
    """How many candidates go linear: ``count`` if given, else ``ratio`` rounded half up.

    Raises:
        ValueError: ratio outside (0, 1], count outside [0, num_candidates], or neither given.
    """
    if count is not None:
        if not 0 <= int(count) <= num_candidates:
            raise ValueError(f"num_linear={count} must be between 0 and the {num_candidates} candidate layers")
        return int(count)
    if ratio is None:
        raise ValueError("give either a ratio in (0, 1] or a layer count")
    if not (0.0 < float(ratio) <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return int(math.floor(ratio * num_candidates + 0.5))


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
    """A layer probe (``LatteParams.probe``) that keeps the last output it saw in ``store[name]``."""

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


def score_stats(run: Any, batches: list, corrections: dict) -> tuple[dict, Tensor]:
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
