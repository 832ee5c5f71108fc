"""The speed-accuracy front of per-layer mode assignments and the choice on it: pure functions
over numbers (``docs/method.md#speed``), with a brute-force reference beside the fast path.

An assignment ``{layer: mode}`` names each non-exact layer's mode; a layer it leaves out is
exact. Each (layer, mode) carries an estimated distortion (the model's cross-fitted output
change with only that layer in that mode) and a saving (milliseconds per forward). Under the
additive model (distortions and savings add up over layers) :func:`pareto_front` finds every
assignment no other beats in both; the calibration then judges a few of them end to end and
:func:`choose_point` picks among the judged ones.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["FrontPoint", "pareto_front", "naive_pareto_front", "thin_front", "choose_point", "SpeedupUnreachable",
           "FRONT_POINTS"]

#: Assignments of the additive front judged end to end (evenly spread over the predicted speed-up).
FRONT_POINTS = 10

Options = Mapping[str, Mapping[str, tuple[float, float]]]  # {layer: {mode: (saving, distortion)}}


@dataclass(frozen=True)
class FrontPoint:
    """One assignment on the front.

    Attributes:
        assignment: ``{layer: mode}`` of the non-exact layers (model order).
        saving: predicted milliseconds saved per forward; additive: the summed single-layer distortions.
        speedup: the predicted end-to-end speed-up. judged: the end-to-end cross-fitted loss (``None``
            until judged).
    """

    assignment: Mapping[str, str]
    saving: float
    additive: float
    speedup: float = 1.0
    judged: Optional[float] = None

    def entry(self) -> dict:
        return {"assignment": dict(self.assignment), "saving_ms": self.saving, "additive": self.additive,
                "predicted_speedup": self.speedup, "judged": self.judged}


def _prune(points: list[tuple[float, float, tuple]]) -> list[tuple[float, float, tuple]]:
    """The non-dominated ``(saving, distortion, assignment)`` points, by saving descending (a point
    is kept only if its distortion is below that of every point saving at least as much)."""
    out: list = []
    for s, d, a in sorted(points, key=lambda p: (-p[0], p[1])):
        if not out or d < out[-1][1]:
            out.append((s, d, a))
    return out


def pareto_front(options: Options) -> list[tuple[float, float, dict]]:
    """The exact additive Pareto front, layer by layer (each layer's options merged into the
    front so far, dominated points dropped at every step): ``[(saving, distortion, assignment)]``
    by saving ascending, the all-exact assignment first. Modes that save nothing are never
    better than exact (their distortion is >= 0) and fall out."""
    front: list = [(0.0, 0.0, ())]
    for layer, modes in options.items():
        merged = [(s + ms, d + md, a + ((layer, m),)) for s, d, a in front for m, (ms, md) in modes.items()]
        front = _prune(front + merged)
    return [(s, d, dict(a)) for s, d, a in reversed(front)]


def naive_pareto_front(options: Options) -> list[tuple[float, float, dict]]:
    """:func:`pareto_front` by enumerating every assignment (the reference the tests compare to)."""
    layers = list(options)
    every = []
    for choice in itertools.product(*[[None, *options[n]] for n in layers]):
        a = tuple((n, m) for n, m in zip(layers, choice) if m is not None)
        every.append((sum(options[n][m][0] for n, m in a), sum(options[n][m][1] for n, m in a), a))
    return [(s, d, dict(a)) for s, d, a in reversed(_prune(every))]


def thin_front(front: Sequence[FrontPoint], count: int = FRONT_POINTS,
               keep: Sequence[FrontPoint] = ()) -> list[FrontPoint]:
    """At most ``count`` points (plus ``keep``) spread evenly over the predicted speed-up, the
    fastest always included (ascending speed-up, no duplicates)."""
    if len(front) <= count:
        chosen = list(front)
    else:
        lo, hi = front[0].speedup, front[-1].speedup
        chosen = []
        for i in range(count):
            goal = lo + (hi - lo) * (i + 1) / count
            chosen.append(min(front, key=lambda p: (abs(p.speedup - goal), p.additive)))
    out: dict = {}
    for p in sorted([*chosen, *keep], key=lambda p: p.speedup):
        out.setdefault(tuple(sorted(p.assignment.items())), p)
    return list(out.values())


class SpeedupUnreachable(ValueError):
    """``speedup=`` above the largest predicted speed-up any assignment reaches."""


def choose_point(points: Sequence[FrontPoint], speedup: Optional[float] = None,
                 target: Optional[float] = None) -> FrontPoint:
    """The judged point to apply.

    ``speedup``: the lowest judged loss among points predicted at >= ``speedup`` (ties: the
    faster). ``target``: the highest predicted speed-up among points judged within ``target``
    (the all-exact point, judged 0, always qualifies).

    Raises:
        SpeedupUnreachable: no point reaches ``speedup``; names the largest predicted speed-up.
    """
    if speedup is not None:
        fast = [p for p in points if p.speedup >= float(speedup) - 1e-12]
        if not fast:
            best = max((p.speedup for p in points), default=1.0)
            raise SpeedupUnreachable(f"speedup={float(speedup):g} is above what the front offers: the largest "
                                     f"predicted end-to-end speed-up at this input size is {best:.2f}x; ask for at "
                                     f"most {best:.2f}")
        return min(fast, key=lambda p: (p.judged, -p.speedup))
    if target is None:
        raise ValueError("choose_point needs speedup= or target=")
    within = [p for p in points if p.judged is not None and p.judged <= float(target)]
    return max(within, key=lambda p: (p.speedup, -p.judged)) if within else FrontPoint({}, 0.0, 0.0, 1.0, 0.0)
