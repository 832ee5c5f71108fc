"""Which calibration image plays which role, and the judge that never lets an image judge a
correction fitted on it (``docs/method.md#calibration``, ``docs/method.md#cross-fitting``).

* :func:`split_calibration` deals this rank's images to the roles ``fit``, ``choose`` and
  ``report`` by global position (the same split whatever the number of processes), and the
  fit and choice images to those that search and those that judge;
* :func:`fold_assignment` deals the fit and choice images to the cross-fitting folds;
* :func:`measured` and :func:`output_distortion` measure a linear set on some images with the
  corrections the layers hold; :func:`cross_fitted` and :class:`CrossFitJudge` run each image
  with the corrections fitted without its fold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..nn.install import set_modes
from ..nn.params import LatteParams
from .config import CROSS_FIT_FOLDS, LatteConfig
from .context import ROLES, AllReduce, CalibrationRun, CalibrationSplit, Measure
from .corrections import FittedCorrection, assign_folds, set_correction
from .measures import MatchedRawDistortion, RawDistortion

__all__ = ["image_role", "compares_configurations", "split_calibration",
           "fold_assignment", "image_counts", "measured", "output_distortion", "Verdict", "merged", "cross_fitted", "CrossFitJudge",
           "HalfSearch", "across_halves", "on_every_image", "unsearched", "confirmed_set", "configuration_judge",
           "search_measure"]


def image_role(position: int, holdout: float) -> str:
    """``fit``, ``choose`` or ``report`` for a global batch position.

    Every ``round(1 / holdout)``-th position is held out; held-out positions alternate between
    ``choose`` (they pick the L-BFGS step count) and ``report`` (nothing is fitted on or chosen
    by them).
    """
    if holdout <= 0:
        return "fit"
    period = max(2, int(round(1.0 / float(holdout))))
    if position % period != period - 1:
        return "fit"
    return "choose" if (position // period) % 2 == 0 else "report"


def compares_configurations(cfg: LatteConfig) -> bool:
    """Whether the settings leave a choice among whole configurations (``selection`` or
    ``correction`` is ``auto``), so that some images must be kept to judge them."""
    return cfg.selection == "auto" or cfg.correction == "auto"


def split_calibration(batches: Sequence[Any], positions: Sequence[int], cfg: LatteConfig,
                      reduce: AllReduce) -> CalibrationSplit:
    """Deals this rank's batches to the roles, then the fit and choice images to the halves by
    the parity of their rank among the global fit and choice positions (whichever rank holds
    them): two halves when configurations are compared (:func:`compares_configurations`) and
    there are at least two images, else one. Each half's searches compare outputs on its first
    ``greedy_images // 2`` images (``greedy_images`` with one half), so the searches together
    see ``greedy_images`` images."""
    split = CalibrationSplit()
    for pos, batch in zip(positions, batches):
        getattr(split, image_role(int(pos), cfg.holdout)).append((int(pos), batch))
    local = torch.tensor([float(len(getattr(split, r))) for r in ROLES], dtype=torch.float64)
    split.counts = dict(zip(ROLES, (int(x) for x in reduce(local).tolist())))
    split.used = sorted(split.fit + split.choose, key=lambda pb: pb[0])
    rank = {}  # global position -> index among the global fit and choice positions
    for g in range(max((p for p, _ in split.used), default=-1) + 1):
        if image_role(g, cfg.holdout) != "report":
            rank[g] = len(rank)
    two = compares_configurations(cfg) and split.counts["fit"] + split.counts["choose"] >= 2
    split.halves = [[pb for pb in split.used if rank[pb[0]] % 2 == h] for h in range(2)] if two else [split.used]
    per_half = max(1, cfg.greedy_images // 2) if two else max(1, cfg.greedy_images)
    split.greedy = [[pb for pb in half if rank[pb[0]] // len(split.halves) < per_half] for half in split.halves]
    return split


def output_distortion(layers: dict[str, LatteParams], batches: list, forward: Callable[[Any], Any],
                      reduce: AllReduce, relative: bool = False) -> Callable[[list[str]], float]:
    """``linear layers -> mean squared change of the model's raw outputs`` on ``batches`` (global);
    with ``relative``, divided by the mean square of the exact outputs. The layers keep the
    corrections they hold (fitted on the fit images)."""
    return measured(layers, batches, RawDistortion(forward, relative), reduce)


def measured(layers: dict[str, LatteParams], batches: list, measure: Measure,
             reduce: AllReduce) -> Callable[[list[str]], float]:
    """``linear layers -> measure's loss`` on ``batches`` (``(position, batch)``, summed across ranks)."""
    set_modes(layers, [])
    refs = [measure.run(b) for _, b in batches]

    def loss(linear: list[str]) -> float:
        set_modes(layers, linear)
        acc = measure.zeros()
        for (_, b), r in zip(batches, refs):
            acc = acc + measure.sums(r, measure.run(b))
        return measure.loss(reduce(acc))

    return loss


def fold_assignment(split: CalibrationSplit, cfg: LatteConfig, reduce: AllReduce,
                    shard: tuple[int, int]) -> dict[int, int]:
    """``{global position: fold}`` of the fit and choice images up to the largest position of any
    rank (every rank computes the same map: ``share_items`` gives each rank the others' images)."""
    rank, world = shard
    ends = torch.zeros(world, dtype=torch.float64)  # each rank's largest position + 1 (a max through sums)
    ends[rank] = max([p + 1 for role in ROLES for p, _ in getattr(split, role)], default=0)
    n = int(max(reduce(ends).max().item(), sum(split.counts.values())))
    return assign_folds([g for g in range(n) if image_role(g, cfg.holdout) != "report"], CROSS_FIT_FOLDS)


@dataclass
class Verdict:
    """A linear set's loss on the judging images: the whole set's, and each image's (for the
    paired comparisons of :mod:`~latte_plugin.calibration.select`)."""

    loss: float
    per_image: Tensor  # (images,) in global position order
    sums: Optional[Tensor] = None  # the measure's sums over the images (verdicts on disjoint images add up)


def merged(verdicts: Sequence[Verdict], measure: Measure) -> Verdict:
    """One verdict from verdicts on disjoint image sets (per-image losses concatenated)."""
    total = sum((v.sums for v in verdicts), measure.zeros())
    return Verdict(measure.loss(total), torch.cat([v.per_image for v in verdicts]), total)


def cross_fitted(layers: dict[str, LatteParams], corrections: Mapping[str, FittedCorrection], batches: list,
                 fold_of: dict[int, int], measure: Measure, reduce: AllReduce, refs: list) -> Callable[[list[str]], Verdict]:
    """``linear layers -> Verdict`` of ``measure`` on ``batches``, each image run with every linear
    layer's output correction chosen and fitted *without* that image's fold
    (:class:`~latte_plugin.calibration.corrections.FittedCorrection`), so no image judges a correction
    fitted on it. The full corrections are restored afterwards. ``refs``: the exact model's
    ``measure.run`` of each batch (:class:`CrossFitJudge` keeps them).

    The kernel scalars (two per layer or head) are fitted on every fit image and not cross-fitted.
    """
    folds = sorted({fold_of[p] for p, _ in batches})
    size = max(fold_of) + 1 if fold_of else 0

    def verdict(linear: list[str]) -> Verdict:
        set_modes(layers, linear)
        zero = measure.zeros()
        rows = torch.zeros(size, zero.numel() + 1, dtype=torch.float64)  # per image: sums, then "judged"
        try:
            for f in folds:
                for n in linear:
                    set_correction(layers[n], *corrections[n].folds[f])
                for (p, b), r in zip(batches, refs):
                    if fold_of[p] == f:
                        rows[p, :-1] += measure.sums(r, measure.run(b)).double().reshape(-1)
                        rows[p, -1] = 1.0
        finally:
            for n in linear:
                set_correction(layers[n], corrections[n].kind, corrections[n].weights)
        rows = reduce(rows)
        judged = [r[:-1].to(zero.dtype).reshape(zero.shape) for r in rows[rows[:, -1] > 0]]
        total = sum(judged, zero)
        return Verdict(measure.loss(total), torch.tensor([measure.loss(r) for r in judged], dtype=torch.float64), total)

    return verdict


class CrossFitJudge:
    """:func:`cross_fitted` on fixed images, with the exact model's outputs computed once per
    measure and each (measure, set, corrections)'s verdict remembered (the searches, the choice
    of configuration, the compensation and the target ask for some sets more than once)."""

    def __init__(self, layers: dict[str, LatteParams], batches: list, fold_of: dict[int, int],
                 reduce: AllReduce) -> None:
        self.layers, self.batches, self.fold_of, self.reduce = layers, batches, fold_of, reduce
        self._refs: dict[str, list] = {}
        self._memo: dict[tuple, Verdict] = {}

    def __call__(self, measure: Measure, corrections: Mapping[str, FittedCorrection],
                 key: Optional[str] = None) -> Callable[[list[str]], Verdict]:
        """``linear layers -> Verdict`` under ``corrections``; remembered (by the corrections'
        signatures) unless ``key`` is None."""
        if measure.name not in self._refs:
            set_modes(self.layers, [])
            self._refs[measure.name] = [measure.run(b) for _, b in self.batches]
        judge = cross_fitted(self.layers, corrections, self.batches, self.fold_of, measure, self.reduce,
                             self._refs[measure.name])
        if key is None:
            return judge

        def remembered(linear: list[str]) -> Verdict:
            # keyed by what the layers run with, not by the rule's name: rules that chose the same
            # candidates (the same weights) share one measurement
            memo = (measure.name, frozenset(linear), tuple(sorted((n, corrections[n].signature()) for n in linear)))
            if memo not in self._memo:
                self._memo[memo] = judge(linear)
            return self._memo[memo]

        return remembered

def image_counts(split: CalibrationSplit, reduce: AllReduce) -> dict:
    """How many images (across ranks) each half holds and how many the searches compared outputs on."""
    local = torch.tensor([float(len(h)) for h in split.halves] + [float(len(g)) for g in split.greedy],
                         dtype=torch.float64)
    counts = [int(x) for x in reduce(local).tolist()]
    n = len(split.halves)
    return {"halves": counts[:n], "greedy_images": sum(counts[n:]), "judge_images": sum(counts[:n]) if n == 2 else 0}


@dataclass
class HalfSearch:
    """One half of the fit and choice images: its score statistics, the candidate sets its
    searches found, and a judge over its images."""

    judge: "CrossFitJudge"
    searcher: "CrossFitJudge"
    stats: dict
    tokens: Tensor
    sets: dict
    traces: dict


def across_halves(halves: list, measure: Measure, corrections: Any, rule: str, method: str, k: int) -> Verdict:
    """A (method, rule) pair judged on every image, each half with the set the *other* half's
    search found (with one half: its own), each image with its fold's corrections."""
    n = len(halves)
    return merged([h.judge(measure, corrections[rule], rule)(halves[(i + 1) % n].sets[(method, k)])
                   for i, h in enumerate(halves)], measure)


def on_every_image(halves: list, measure: Measure, corrections: Mapping[str, FittedCorrection], key: str, layers: list[str]) -> Verdict:
    """``layers`` judged on every fit and choice image with ``corrections`` (cross-fitted)."""
    return merged([h.judge(measure, corrections, key)(layers) for h in halves], measure)


def unsearched(split: CalibrationSplit) -> list:
    """This rank's fit and choice images that no search compared outputs on (``(position, batch)``
    in position order): they judge the searches' sets without the bias of the images a set was
    found on (``docs/method.md#final-set``)."""
    searched = {p for g in split.greedy for p, _ in g}
    return [pb for pb in split.used if pb[0] not in searched]


def confirmed_set(run: CalibrationRun, corrections: Mapping, candidates: list) -> tuple[list, list, dict]:
    """Of the candidate ``(layers, trace)`` (distinct sets, the set searched again first), the one of
    lowest cross-fitted ``run.judge`` loss on the fit and choice images no search compared outputs
    on (:func:`~.judge.unsearched`; the first wins ties); the first where there are none.

    Returns:
        ``(layers, trace, {"sets", "losses", "kept", "images"})`` (the last for the report).
    """
    distinct = [c for i, c in enumerate(candidates) if all(set(c[0]) != set(d[0]) for d in candidates[:i])]
    batches = unsearched(run.split)
    images = int(run.reduce(torch.tensor([float(len(batches))], dtype=torch.float64))[0])
    info: dict = {"sets": [list(c[0]) for c in distinct], "images": images, "measure": run.judge.name}
    if images == 0 or len(distinct) == 1:  # nothing to judge on, or nothing to choose between
        return (*distinct[0], {**info, "kept": 0, "losses": None})
    judge = CrossFitJudge(run.layers, batches, run.fold_of, run.reduce)(run.judge, corrections)
    losses = [judge(list(c[0])).loss for c in distinct]
    kept = min(range(len(distinct)), key=lambda i: (losses[i], i))
    run.log(f"[latte] final set confirmed on {images} unsearched images: "
            + ", ".join(f"{len(c[0])} layers {v:.4e}" for c, v in zip(distinct, losses)) + f" -> candidate {kept}")
    return (*distinct[kept], {**info, "kept": kept, "losses": losses})


def configuration_judge(cfg: LatteConfig, forward: Callable[[Any], Any], detections: Optional[Measure]) -> Measure:
    """The measure that judges whole configurations and the compensation (``cfg.judge``): the
    raw-output MSE, ``matched`` (the same with the query slots matched by box), or ``detections``
    (the detector adapter's :class:`~latte_plugin.calibration.measures.DetectionDisagreement`;
    ``None`` for other models).

    Raises:
        ValueError: ``judge='detections'`` on a model without a detector's post-processing.
    """
    if cfg.judge == "matched":
        return MatchedRawDistortion(forward)
    if cfg.judge == "detections" and detections is None:
        raise ValueError("judge='detections' needs a detector (an adapter that runs its post-processing); "
                         "use judge='outputs' or 'auto' for this model")
    if cfg.judge != "outputs" and detections is not None:
        return detections
    return RawDistortion(forward, relative=False)


def search_measure(cfg: LatteConfig, forward: Callable[[Any], Any]) -> Measure:
    """The measure the greedy and backward searches and the speed search's single layers compare
    sets with (``cfg.search``): the raw-output MSE slot by slot, or with the query slots matched by
    box (``search='matched'``, or ``judge='matched'``, which has always measured the single layers so)."""
    if cfg.search == "matched" or cfg.judge == "matched":
        return MatchedRawDistortion(forward)
    return RawDistortion(forward, relative=False)
