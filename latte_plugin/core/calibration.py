"""Training-free calibration of one layer's LATTE scalars (spec section 6).

* :class:`LayerRecorder` keeps a bounded, seeded reservoir of what a layer saw.
* :func:`fit_layer` fits ``(alpha, rho, sigma)`` by local reconstruction on it.

Statistics that cross ranks go through an ``all_reduce`` callable that sums a tensor in
place (identity in one process), so every rank computes the same scalars.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from . import kernels
from .layer import LatteParams

__all__ = ["RecordedItem", "LayerRecorder", "fit_layer", "FitResult", "reconstruction_error", "AllReduce"]

AllReduce = Callable[[Tensor], Tensor]


def _no_reduce(t: Tensor) -> Tensor:
    return t


@dataclass
class RecordedItem:
    """One image's view of one layer: the sampled queries, all valid keys and the softmax target.

    Shapes: q ``(H, n, d)``, k ``(H, M, d)``, v ``(H, M, d_v)``, target ``(H, n, d_v)``.
    Padded keys are dropped at record time. ``mask`` ``(1, n, M)`` (``True`` = masked pair)
    is kept only for layers with a general mask (e.g. causal text attention).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    target: Tensor
    mask: Optional[Tensor] = None


@dataclass
class LayerRecorder:
    """Bounded record of a layer's inputs and exact outputs.

    Memory stays bounded whatever the number of images: at most ``max_items`` images are
    kept (reservoir sampling with a fixed seed) and at most ``max_queries`` query tokens of
    each. All keys of a kept image are stored, because linear attention sums over them.

    Args:
        name: the layer's module name, for error messages.
        max_items: images kept per layer.
        max_queries: query tokens kept per image.
        seed: the seed of the sampling generator.
    """

    name: str
    max_items: int = 64
    max_queries: int = 256
    seed: int = 0
    items: list[RecordedItem] = field(default_factory=list)
    seen: int = 0

    def __post_init__(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], out: Tensor,
        attn_mask: Optional[Tensor] = None,
    ) -> None:
        """Records a batch: q ``(B, H, N, d)``, k/v ``(B, H, M, .)``, out ``(B, H, N, d_v)``;
        ``attn_mask`` bool ``(B|1, 1, N, M)`` (``True`` = masked), the same for every head."""
        if attn_mask is not None and attn_mask.shape[1] != 1 and not bool((attn_mask == attn_mask[:, :1]).all()):
            raise ValueError(f"layer '{self.name}': per-head attention masks are not supported by LATTE calibration")
        for name, t in (("q", q), ("k", k), ("v", v), ("output", out)):
            if not bool(torch.isfinite(t).all()):
                raise FloatingPointError(
                    f"non-finite values (NaN/Inf) in the recorded {name} of layer '{self.name}'; "
                    "check the input images and the checkpoint"
                )
        for b in range(q.shape[0]):
            self.seen += 1
            slot = len(self.items)
            if slot >= self.max_items:
                slot = int(torch.randint(self.seen, (1,), generator=self._gen))
                if slot >= self.max_items:
                    continue
            n = q.shape[2]
            if n > self.max_queries:
                idx = torch.randperm(n, generator=self._gen)[: self.max_queries].sort().values
            else:
                idx = torch.arange(n)
            kb, vb = k[b], v[b]
            mask = None
            if attn_mask is not None:
                mask = attn_mask[b if attn_mask.shape[0] > 1 else 0, :1].expand(1, n, k.shape[2])[:, idx.to(q.device)]
            if key_padding_mask is not None:
                keep = ~key_padding_mask[b]
                kb, vb = kb[:, keep], vb[:, keep]
                mask = None if mask is None else mask[:, :, keep]
            item = RecordedItem(
                q=q[b][:, idx].detach().float().cpu(),
                k=kb.detach().float().cpu(),
                v=vb.detach().float().cpu(),
                target=out[b][:, idx].detach().float().cpu(),
                mask=None if mask is None else mask.detach().cpu(),
            )
            if slot == len(self.items):
                self.items.append(item)
            else:
                self.items[slot] = item


@dataclass
class FitResult:
    """Outcome of :func:`fit_layer`: the mean squared errors before and after fitting."""

    initial_mse: float
    final_mse: float
    alpha_init: float


def _sum_count(values: list[tuple[Tensor, float]], all_reduce: AllReduce) -> Tensor:
    acc = torch.zeros(2, dtype=torch.float64)
    for s, c in values:
        acc[0] += float(s)
        acc[1] += c
    return all_reduce(acc)


def softmax_weighted_mean_score(items: list[RecordedItem], all_reduce: AllReduce = _no_reduce) -> float:
    """The spec's starting anchor: the softmax-weighted mean of ``x_ij = <q_i, k_j> / sqrt(d)``."""
    vals = []
    for it in items:
        x = it.q @ it.k.transpose(-1, -2) / math.sqrt(it.q.shape[-1])
        if it.mask is not None:
            p = torch.softmax(x.masked_fill(it.mask, float("-inf")), dim=-1).nan_to_num(0.0)
            x = x.masked_fill(it.mask, 0.0)
        else:
            p = torch.softmax(x, dim=-1)
        vals.append(((p * x).sum(), float(x.shape[0] * x.shape[1])))
    acc = _sum_count(vals, all_reduce)
    if acc[1] == 0:
        raise ValueError("cannot calibrate a layer with no recorded tokens (is the calibration set empty?)")
    return float(acc[0] / acc[1])


def _stack_by_shape(items: list[RecordedItem]) -> list[RecordedItem]:
    """Same-shaped items stacked along a new leading dim: ``(G, H, n, d)``, in float64.

    float64 makes the fit independent of how images are split across ranks (the loss is
    flat along some directions, where float32 summation order would show).

    Fitting then runs one batched op per shape instead of one per image. Groups are kept
    in first-seen order, so the result is deterministic.
    """
    groups: dict[tuple, list[RecordedItem]] = {}
    for it in items:
        key = (tuple(it.q.shape), tuple(it.k.shape), it.mask is None)
        groups.setdefault(key, []).append(it)
    return [
        RecordedItem(
            *(torch.stack([getattr(it, f) for it in g]).double() for f in ("q", "k", "v", "target")),
            mask=None if g[0].mask is None else torch.stack([it.mask for it in g]),
        )
        for g in groups.values()
    ]


def _linear_outputs(layer: LatteParams, it: RecordedItem, m: Tensor, log_rho: Tensor) -> Tensor:
    fq, fk = layer.features(it.q, it.k, m=m, log_rho=log_rho)
    if it.mask is not None:  # general (causal) mask: the quadratic masked form
        return kernels.naive_linear_attention(fq, fk, it.v, attn_mask=it.mask)
    return kernels.linear_attention(fq, fk, it.v)  # (H, n, d_v)


def reconstruction_error(
    layer: LatteParams, items: list[RecordedItem], all_reduce: AllReduce = _no_reduce, use_sigma: bool = True
) -> float:
    """Mean squared error between the layer's current linear output and the recorded softmax output."""
    vals = []
    with torch.no_grad():
        for it in items:
            o = _linear_outputs(layer, it, layer.m, layer.log_rho)
            if use_sigma:
                h, _, dv = o.shape
                o = o * layer.sigma.view(h, 1, dv)
            vals.append((((o - it.target) ** 2).sum(), float(o.numel())))
    acc = _sum_count(vals, all_reduce)
    return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")


def _head_losses(layer: LatteParams, stacked: list[RecordedItem], m: Tensor, log_rho: Tensor, total: float) -> Tensor:
    """Squared error per head ``(H,)``, divided by the global element count."""
    loss = torch.zeros(layer.num_heads, dtype=torch.float64)
    for it in stacked:
        o = _linear_outputs(layer, it, m, log_rho)  # (G, H, n, dv)
        loss = loss + ((o - it.target) ** 2).sum(dim=(0, 2, 3)).double() / total
    return loss


def fit_layer(
    layer: LatteParams,
    items: list[RecordedItem],
    steps: int = 20,
    lr: float = 1.0,
    fit_sigma: bool = True,
    all_reduce: AllReduce = _no_reduce,
    per_head: bool = False,
) -> FitResult:
    """Fits one layer's scalars by local reconstruction (spec section 6.2), in place.

    ``m`` (so alpha) starts at the softmax-weighted mean score and ``log_rho`` at 0. A coarse
    grid over ``(m, log_rho)`` picks the start (robust to the sharpness of the layer), then
    full-batch L-BFGS (``steps`` iterations, strong-Wolfe line search) minimises the mean
    squared error against the recorded softmax outputs, with loss and gradients summed
    across ranks. ``jpn_only`` keeps ``m = 1`` (alpha = 0) and ``qtvit`` has no anchor.
    sigma is then a closed-form per-channel least squares. Deterministic: no sampling here.

    Args:
        layer: the layer whose buffers are set.
        items: its recordings (this rank's share).
        steps: L-BFGS iterations. lr: L-BFGS step scale.
        fit_sigma: fit sigma (else it stays ones).
        all_reduce: sums a tensor across ranks in place.
        per_head: one ``(m, log_rho)`` per head (heads are independent, so the grid picks
            each head's start separately); else one pair shared by the layer (the paper).

    Returns:
        :class:`FitResult` with the MSE at the start (alpha from the weighted mean) and at the end.
    """
    local = torch.tensor([float(len(items))], dtype=torch.float64)
    if float(all_reduce(local)[0]) == 0:
        raise ValueError("empty calibration set: no image reached the layer; give at least one image")
    variant = layer.variant
    h = layer.num_heads
    alpha0 = softmax_weighted_mean_score(items, all_reduce)
    alpha0 = min(alpha0, 1.0 - 1e-4)
    fit_m = variant in ("latte", "tte_only")
    m0 = math.sqrt(1.0 - alpha0) if fit_m else 1.0
    layer.sigma.fill_(1.0)
    layer.m.fill_(m0)
    layer.log_rho.fill_(0.0)
    initial = reconstruction_error(layer, items, all_reduce, use_sigma=False)

    total = float(_sum_count([(0.0, float(it.target.numel())) for it in items], all_reduce)[1])
    stacked = _stack_by_shape(items)

    def losses(m: Tensor, log_rho: Tensor) -> Tensor:  # (H,), identical on every rank
        return all_reduce(_head_losses(layer, stacked, m.expand(h), log_rho.expand(h), total).detach().clone())

    # coarse start, per head or shared
    n_par = h if per_head else 1
    best = torch.full((n_par,), math.inf, dtype=torch.float64)
    best_m = torch.full((n_par,), m0, dtype=torch.float64)
    best_r = torch.zeros(n_par, dtype=torch.float64)
    with torch.no_grad():
        for mm in (sorted({m0, 0.3, 1.0, 2.0}) if fit_m else [m0]):
            for r0 in (0.0, 2.0, 4.0, 8.0):
                one = torch.tensor([mm], dtype=torch.float64)
                val = losses(one, torch.tensor([r0], dtype=torch.float64))
                val = val if per_head else val.sum().reshape(1)
                better = val < best
                best = torch.where(better, val, best)
                best_m = torch.where(better, one, best_m)
                best_r = torch.where(better, torch.full_like(best_r, r0), best_r)
    m = best_m.clone().requires_grad_(fit_m)
    log_rho = best_r.clone().requires_grad_(True)
    params = [p for p in (m, log_rho) if p.requires_grad]
    if steps > 0:
        opt = torch.optim.LBFGS(params, lr=lr, max_iter=steps, line_search_fn="strong_wolfe",
                                tolerance_grad=1e-12, tolerance_change=1e-14)

        def closure() -> Tensor:
            opt.zero_grad()
            with torch.enable_grad():
                loss = _head_losses(layer, stacked, m.expand(h), log_rho.expand(h), total).sum()
                grads = torch.autograd.grad(loss, params)
            g = all_reduce(torch.stack([x.detach() for x in grads]))
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            return all_reduce(loss.detach().reshape(1).clone())[0]

        opt.step(closure)
    with torch.no_grad():
        m_fit = m.detach().abs().clone()
        r_fit = log_rho.detach().clamp(-20.0, 20.0)  # keeps the gauge from drifting to overflow
        fitted = losses(m_fit, r_fit)
        fitted = fitted if per_head else fitted.sum().reshape(1)
        # where the line search wandered off (non-finite or worse), keep the grid's best
        bad = ~torch.isfinite(fitted) | ~torch.isfinite(m_fit) | (fitted > best)
        m_fit = torch.where(bad, best_m, m_fit)
        r_fit = torch.where(bad, best_r, r_fit)
    layer.m.copy_(m_fit.expand(h))
    layer.log_rho.copy_(r_fit.expand(h))

    if fit_sigma:
        num = torch.zeros(layer.embed_dim, dtype=torch.float64)
        den = torch.zeros(layer.embed_dim, dtype=torch.float64)
        with torch.no_grad():
            for it in stacked:
                o = _linear_outputs(layer, it, layer.m.double(), layer.log_rho.double())  # (G, H, n, dv)
                num += (o.double() * it.target).sum(dim=(0, 2)).reshape(-1)
                den += (o.double() * o).sum(dim=(0, 2)).reshape(-1)
        sums = all_reduce(torch.stack([num, den]))
        sigma = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1e-30), torch.ones_like(sums[0]))
        layer.sigma.copy_(sigma.float())
    final = reconstruction_error(layer, items, all_reduce, use_sigma=True)
    layer.calibrated.fill_(True)
    return FitResult(initial_mse=initial, final_mse=final, alpha_init=alpha0)
