"""Which kernel a linear layer runs, and the piecewise kernel's knobs (``docs/method.md#piecewise``).

After a layer's LATTE scalars are fitted, :func:`choose_kernel` compares, on the layer's recorded
fit and choice images dealt to the cross-fitting folds, the LATTE kernel against the piecewise
kernel at every (exact key blocks, mass scale) candidate. The piecewise knobs are chosen inside
the folds: each fold is measured with the knobs the other folds chose, so the piecewise error
that decides ``kernel='auto'`` is cross-fitted. (LATTE's two scalars are fitted on every image,
so its error is in-sample: the comparison leans towards LATTE.) Errors are before the output
correction, which is fitted afterwards on the chosen kernel's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..nn.params import LatteParams
from .config import CROSS_FIT_FOLDS, PIECEWISE_GAMMAS, PIECEWISE_SLACK, PIECEWISE_TOPS
from .corrections import FitOptions, LayerRecords, linear_outputs, partition
from ..ops.piecewise import similarity_groups
from .record import RecordedItem, stack_by_shape

__all__ = ["KernelChoice", "choose_kernel", "piecewise_candidates", "pick_piecewise"]

Candidate = tuple[int, float]  # (exact key blocks per query block, mass scale)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel a layer took and why.

    Attributes:
        kernel: ``latte`` or ``piecewise``. top, gamma, rest: the piecewise knobs (``None`` for LATTE).
        crossfit: ``{"latte": MSE, "piecewise": cross-fitted MSE}`` over the fit and choice images.
        errors: ``{"piecewise@<top>": MSE at its best gamma}`` over every fold (what chose ``top``).
        reason: why the piecewise kernel was not considered, when it was not.
    """

    kernel: str
    top: Optional[int] = None
    gamma: Optional[float] = None
    rest: Optional[str] = None
    crossfit: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    reason: str = ""
    order: Optional[str] = None

    def entry(self) -> dict:
        return {"kernel": self.kernel, "top": self.top, "gamma": self.gamma, "rest": self.rest, "order": self.order,
                "crossfit": self.crossfit, "errors": self.errors, **({"reason": self.reason} if self.reason else {})}


def piecewise_candidates(items: Sequence[RecordedItem], block: int, top: Optional[int],
                         order: str = "tokens") -> list[Candidate]:
    """The (top, gamma) pairs to compare: ``top`` fixed, or every :data:`PIECEWISE_TOPS` count that
    leaves some key of some image approximated (a count covering every key is exact softmax at a
    higher cost)."""
    most_blocks = max(similarity_groups(it.k.shape[-2], block, order)[0] for it in items)
    tops = [int(top)] if top is not None else [t for t in PIECEWISE_TOPS if t < most_blocks]
    return [(t, g) for t in tops for g in PIECEWISE_GAMMAS]


def pick_piecewise(mse: dict[Candidate, float]) -> Candidate:
    """The fewest exact blocks whose best-gamma error is within :data:`PIECEWISE_SLACK` of the best
    candidate's, at its best gamma (ties: the smaller gamma)."""
    best = min(mse.values())
    by_top: dict[int, Candidate] = {}
    for (t, g), e in sorted(mse.items()):
        if t not in by_top or e < mse[by_top[t]]:
            by_top[t] = (t, g)
    return next(c for t, c in sorted(by_top.items()) if mse[c] <= PIECEWISE_SLACK * best)


def _fold_sse(layer: LatteParams, parts: list[list[RecordedItem]]) -> list[tuple[float, float]]:
    """``[(squared error, elements)]`` per fold of the layer's current kernel (no output correction)."""
    out = []
    for part in parts:
        sse = cnt = 0.0
        for it in part:
            o = linear_outputs(layer, it, layer.m.double(), layer.log_rho.double())
            sse += float(((o - it.target) ** 2).sum())
            cnt += float(o.numel())
        out.append((sse, cnt))
    return out


def _mse(pairs: Sequence[tuple[float, float]]) -> float:
    sse, cnt = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return sse / cnt if cnt else float("nan")


@torch.no_grad()
def choose_kernel(layer: LatteParams, records: LayerRecords, opts: FitOptions) -> KernelChoice:
    """Chooses and sets ``layer``'s kernel (``opts.kernel``: ``piecewise`` or ``auto``; module docstring).

    Args:
        layer: a layer whose LATTE scalars are fitted. records: its recorded items by role.
        opts: the fit's options: ``fold_of`` deals the items to folds; ``piecewise_*`` the piecewise
            settings (``piecewise_top=None``: chosen among :data:`PIECEWISE_TOPS`).

    Returns:
        The :class:`KernelChoice`; the layer holds it.
    """
    kernel, block, rest, order = opts.kernel, opts.piecewise_block, opts.piecewise_rest, opts.piecewise_order
    layer.kernel = "latte"
    items = list(records.fit) + list(records.choose)
    if any(it.q_pool is None for it in items):
        return KernelChoice("latte", reason="a general attention mask (or no pooled queries recorded)")
    cands = piecewise_candidates(items, block, opts.piecewise_top, order)
    if not cands:
        return KernelChoice("latte", reason=f"at most {min(PIECEWISE_TOPS)} key block(s) of {block} tokens: "
                                            "nothing would be approximated")
    folds = max(opts.fold_of.values()) + 1 if opts.fold_of else CROSS_FIT_FOLDS
    parts = [stack_by_shape(p) for p in partition(items, folds, opts.fold_of) if p]
    latte = _fold_sse(layer, parts)
    per_fold: dict[Candidate, list[tuple[float, float]]] = {}
    for t, g in cands:
        layer.set_piecewise(t, g, rest, block, order)
        per_fold[(t, g)] = _fold_sse(layer, parts)
    crossfit = []
    for f in range(len(parts)):  # each fold measured with the knobs the other folds chose
        others = {c: _mse([p for i, p in enumerate(v) if i != f]) for c, v in per_fold.items()}
        pick = pick_piecewise(others) if len(parts) > 1 else pick_piecewise({c: _mse(v) for c, v in per_fold.items()})
        crossfit.append(per_fold[pick][f])
    everywhere = {c: _mse(v) for c, v in per_fold.items()}
    t, g = pick_piecewise(everywhere)
    errors = {f"piecewise@{tt}": min(e for (ct, _), e in everywhere.items() if ct == tt)
              for tt in sorted({c[0] for c in cands})}
    scores = {"latte": _mse(latte), "piecewise": _mse(crossfit)}
    use = kernel == "piecewise" or scores["piecewise"] < scores["latte"]
    if not use:
        layer.kernel = "latte"
        return KernelChoice("latte", crossfit=scores, errors=errors)
    layer.set_piecewise(t, g, rest, block, order)
    return KernelChoice("piecewise", t, g, rest, scores, errors, order=order)
