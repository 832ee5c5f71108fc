"""Which calibration image plays which role, and the judge that never lets an image judge a
correction fitted on it (``docs/method.md#calibration``, ``docs/method.md#cross-fitting``).

* :func:`split_calibration` deals this rank's images to the roles ``fit``, ``choose`` and
  ``report`` by global position (the same split whatever the number of processes);
* :func:`fold_assignment` deals the fit and choice images to the cross-fitting folds;
* :func:`measured` and :func:`output_distortion` measure a linear set on some images with the
  corrections the layers hold; :func:`cross_fitted` and :class:`CrossFitJudge` run each image
  with the corrections fitted without its fold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .calibration import CROSS_FIT_FOLDS, AllReduce, assign_folds, set_correction
from .fidelity import RawDistortion
from .layer import LatteParams, set_modes
from .settings import LatteConfig

__all__ = ["ROLES", "CalibrationSplit", "image_role", "split_calibration", "fold_assignment", "judge_images",
           "measured", "output_distortion", "cross_fitted", "CrossFitJudge"]


#: The roles of calibration images: fitted on; choosing the knobs; only reporting held-out errors.
ROLES = ("fit", "choose", "report")


@dataclass
class CalibrationSplit:
    """This rank's calibration batches by role, each as ``(global position, batch)``.

    The roles come from the global position alone (:func:`image_role`), so the split is the
    same whatever the number of processes. ``greedy`` is the global selections' subset of ``fit``.
    """

    fit: list = field(default_factory=list)
    choose: list = field(default_factory=list)
    report: list = field(default_factory=list)
    greedy: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def image_role(position: int, holdout: float) -> str:
    """``fit``, ``choose`` or ``report`` for a global batch position.

    Every ``round(1 / holdout)``-th position is held out; held-out positions alternate between
    ``choose`` (they pick the knobs) and ``report`` (nothing is fitted on or chosen by them).
    """
    if holdout <= 0:
        return "fit"
    period = max(2, int(round(1.0 / float(holdout))))
    if position % period != period - 1:
        return "fit"
    return "choose" if (position // period) % 2 == 0 else "report"


def split_calibration(batches: Sequence[Any], positions: Sequence[int], cfg: LatteConfig,
                      reduce: AllReduce) -> CalibrationSplit:
    """Deals this rank's batches to the roles and picks the global greedy subset of ``fit``:
    the ``greedy_images`` fit positions of lowest global position (whichever rank holds them)."""
    split = CalibrationSplit()
    for pos, batch in zip(positions, batches):
        getattr(split, image_role(int(pos), cfg.holdout)).append((int(pos), batch))
    fit_rank = {}  # global position -> index among the global fit positions (a function of the position)
    for g in range(max((int(p) for p in positions), default=-1) + 1):
        if image_role(g, cfg.holdout) == "fit":
            fit_rank[g] = len(fit_rank)
    split.greedy = [(p, b) for p, b in split.fit if fit_rank[p] < max(1, cfg.greedy_images)]
    local = torch.tensor([float(len(getattr(split, r))) for r in ROLES], dtype=torch.float64)
    split.counts = dict(zip(ROLES, (int(x) for x in reduce(local).tolist())))
    return split


def output_distortion(layers: dict[str, LatteParams], batches: list, forward: Callable[[Any], Any],
                      reduce: AllReduce, relative: bool = False) -> Callable[[list[str]], float]:
    """``linear layers -> mean squared change of the model's raw outputs`` on ``batches`` (global);
    with ``relative``, divided by the mean square of the exact outputs. The layers keep the
    corrections they hold (fitted on the fit images)."""
    return measured(layers, batches, RawDistortion(forward, relative), reduce)


def measured(layers: dict[str, LatteParams], batches: list, measure: Any,
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


def cross_fitted(layers: dict[str, LatteParams], corrections: dict, batches: list, fold_of: dict[int, int],
                 measure: Any, reduce: AllReduce, refs: list) -> Callable[[list[str]], float]:
    """``linear layers -> measure's loss`` on ``batches``, each image run with every linear
    layer's output correction fitted *without* that image's fold (:func:`fit_layers`), so no
    image judges a correction fitted on it. The full corrections are restored afterwards.
    ``refs``: the exact model's ``measure.run`` of each batch (:class:`CrossFitJudge` keeps them).

    The kernel scalars (two per layer) are fitted on the fit images and not cross-fitted.
    """
    folds = sorted({fold_of[p] for p, _ in batches})

    def loss(linear: list[str]) -> float:
        set_modes(layers, linear)
        acc = measure.zeros()
        try:
            for f in folds:
                for n in linear:
                    kind, _, per_fold = corrections[n]
                    set_correction(layers[n], kind, per_fold[f])
                for (p, b), r in zip(batches, refs):
                    if fold_of[p] == f:
                        acc = acc + measure.sums(r, measure.run(b))
        finally:
            for n in linear:
                kind, full, _ = corrections[n]
                set_correction(layers[n], kind, full)
        return measure.loss(reduce(acc))

    return loss


class CrossFitJudge:
    """:func:`cross_fitted` with the exact model's outputs computed once per measure and each
    set's loss under the fitted corrections remembered (the selection, the compensation and
    the target ask for some sets more than once)."""

    def __init__(self, layers: dict[str, LatteParams], corrections: dict, batches: list, fold_of: dict[int, int],
                 reduce: AllReduce) -> None:
        self.layers, self.corrections, self.batches, self.fold_of, self.reduce = (
            layers, corrections, batches, fold_of, reduce)
        self._refs: dict[str, list] = {}
        self._memo: dict[tuple, float] = {}

    def __call__(self, measure: Any, corrections: Optional[dict] = None) -> Callable[[list[str]], float]:
        """``linear layers -> cross-fitted loss``; ``corrections`` replaces the fitted ones (not remembered)."""
        if measure.name not in self._refs:
            set_modes(self.layers, [])
            self._refs[measure.name] = [measure.run(b) for _, b in self.batches]
        loss = cross_fitted(self.layers, corrections or self.corrections, self.batches, self.fold_of, measure,
                            self.reduce, self._refs[measure.name])
        if corrections is not None:
            return loss

        def remembered(linear: list[str]) -> float:
            key = (measure.name, frozenset(linear))
            if key not in self._memo:
                self._memo[key] = loss(linear)
            return self._memo[key]

        return remembered

    def forget(self) -> None:
        """Drops the remembered losses (after the fitted corrections changed)."""
        self._memo.clear()


def judge_images(split: CalibrationSplit, reduce: AllReduce) -> list:
    """This rank's images that judge selections: fit and choice images the greedy and backward
    searches did not see (all fit and choice images if, across ranks, that leaves none)."""
    seen = {p for p, _ in split.greedy}
    images = sorted(split.fit + split.choose, key=lambda pb: pb[0])
    unseen = [pb for pb in images if pb[0] not in seen]
    return unseen if float(reduce(torch.tensor([float(len(unseen))], dtype=torch.float64))[0]) > 0 else images
