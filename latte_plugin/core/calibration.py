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


#: L-BFGS iteration counts compared on held-out items (capped at ``steps``).
STEP_CHECKPOINTS = (5, 10, 20, 40, 80)
#: Ridge strengths of the output refit, relative to the mean energy of its inputs.
REFIT_REGS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


@dataclass
class FitResult:
    """Outcome of :func:`fit_layer`.

    Attributes:
        initial_mse, final_mse: fit-set MSE at the start (alpha from the weighted mean) and at the end.
        alpha_init: the starting anchor.
        heldout_mse: held-out MSE of the final scalars and correction (fitted without those items).
        steps: the L-BFGS iterations kept (chosen on held-out items when there are any).
        refit_reg: the chosen ridge strength of the output refit (``None`` without refit).
        heldout: the held-out comparisons: ``{"steps": {n: mse}, "refit_reg": {reg: mse},
            "correction": {"none": mse, "sigma": mse, "refit": mse}}``.
    """

    initial_mse: float
    final_mse: float
    alpha_init: float
    heldout_mse: Optional[float] = None
    steps: Optional[int] = None
    refit_reg: Optional[float] = None
    heldout: dict = field(default_factory=dict)


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
            if use_sigma:  # sigma and, if fitted, the output refit
                o = layer.correct(o)
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


def _rows(o: Tensor) -> Tensor:
    """``(G, H, n, d_v)`` or ``(H, n, d_v)`` -> ``(rows, H * d_v)``: heads concatenated per token."""
    if o.dim() == 3:
        o = o.unsqueeze(0)
    g, h, n, dv = o.shape
    return o.permute(0, 2, 1, 3).reshape(g * n, h * dv)


def _normal_sums(layer: LatteParams, stacked: list[RecordedItem], all_reduce: AllReduce) -> dict[str, Tensor]:
    """Sufficient statistics of the output correction, summed across ranks (float64):
    ``xtx`` ``(C+1, C+1)`` and ``xty`` ``(C+1, C)`` with a ones column, ``yty`` and ``rows``."""
    c = layer.embed_dim
    xtx = torch.zeros(c + 1, c + 1, dtype=torch.float64)
    xty = torch.zeros(c + 1, c, dtype=torch.float64)
    rest = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for it in stacked:
            x = _rows(_linear_outputs(layer, it, layer.m.double(), layer.log_rho.double()).double())
            y = _rows(it.target.double())
            x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
            xtx += x1.t() @ x1
            xty += x1.t() @ y
            rest[0] += (y * y).sum()
            rest[1] += x.shape[0]
    flat = all_reduce(torch.cat([xtx.reshape(-1), xty.reshape(-1), rest]))
    n1, n2 = (c + 1) ** 2, (c + 1) * c
    return {"xtx": flat[:n1].view(c + 1, c + 1), "xty": flat[n1:n1 + n2].view(c + 1, c),
            "yty": flat[-2], "rows": flat[-1]}


def _add_sums(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: a[k] + b[k] for k in a}


def _correction_mse(w: Tensor, sums: dict[str, Tensor]) -> float:
    """MSE of ``[x, 1] w`` against ``y`` from the sums: ``(tr(w'XtXw) - 2 tr(w'XtY) + YtY) / (rows C)``."""
    c = w.shape[1]
    sse = (w * (sums["xtx"] @ w)).sum() - 2 * (w * sums["xty"]).sum() + sums["yty"]
    return float(sse / (sums["rows"] * c)) if float(sums["rows"]) > 0 else float("nan")


def _identity_w(c: int, diag: Optional[Tensor] = None) -> Tensor:
    w = torch.zeros(c + 1, c, dtype=torch.float64)
    w[:c].diagonal().copy_(torch.ones(c, dtype=torch.float64) if diag is None else diag.double())
    return w


def _sigma_from_sums(sums: dict[str, Tensor]) -> Tensor:
    c = sums["xty"].shape[1]
    num, den = sums["xty"][:c].diagonal(), sums["xtx"][:c, :c].diagonal()
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.ones_like(num))


def _ridge(sums: dict[str, Tensor], reg: float) -> Tensor:
    """Ridge refit pulled towards the identity (no refit): ``(C+1, C)`` weights.

    ``min ||[x, 1] w - y||^2 + lam ||W - I||^2`` with ``lam = reg * mean(diag(XtX))``, so
    ``reg`` is scale-free. The bias row is not penalised.
    """
    c = sums["xty"].shape[1]
    lam = reg * float(sums["xtx"][:c, :c].diagonal().mean().clamp_min(1e-30))
    pen = torch.ones(c + 1, dtype=torch.float64)
    pen[c] = 0.0
    a = sums["xtx"] + lam * torch.diag(pen)
    b = sums["xty"] + lam * _identity_w(c)
    return torch.linalg.solve(a + 1e-12 * torch.eye(c + 1, dtype=torch.float64), b)


def fit_layer(
    layer: LatteParams,
    items: list[RecordedItem],
    steps: int = 20,
    lr: float = 1.0,
    fit_sigma: bool = True,
    all_reduce: AllReduce = _no_reduce,
    per_head: bool = False,
    heldout: Optional[list[RecordedItem]] = None,
    refit: bool = False,
    refit_regs: tuple = REFIT_REGS,
) -> FitResult:
    """Fits one layer's scalars by local reconstruction (spec section 6.2), in place.

    ``m`` (so alpha) starts at the softmax-weighted mean score and ``log_rho`` at 0. A coarse
    grid over ``(m, log_rho)`` picks the start (robust to the sharpness of the layer), then
    full-batch L-BFGS (strong-Wolfe line search) minimises the mean squared error against
    the recorded softmax outputs, with loss and gradients summed across ranks. ``jpn_only``
    keeps ``m = 1`` (alpha = 0) and ``qtvit`` has no anchor. Deterministic: no sampling here.

    With ``heldout`` items (images not used for fitting), the knobs are chosen on them: the
    number of L-BFGS iterations (among :data:`STEP_CHECKPOINTS` up to ``steps``, 0 = the grid
    start) and the ridge strength of the refit. The output correction is then fitted in
    closed form on all items: sigma (per-channel least squares, the paper) or, with
    ``refit``, a ridge-regularised full ``C x C`` refit of the output (beyond the paper).

    Args:
        layer: the layer whose buffers are set.
        items: its recordings used for fitting (this rank's share).
        steps: maximum L-BFGS iterations. lr: L-BFGS step scale.
        fit_sigma: fit sigma (else it stays ones; ignored with ``refit``).
        all_reduce: sums a tensor across ranks in place.
        per_head: one ``(m, log_rho)`` per head; else one pair shared by the layer (the paper).
        heldout: recordings of held-out images, for choosing the knobs (optional).
        refit: fit the full output refit instead of sigma.
        refit_regs: ridge strengths compared on ``heldout`` (one value: used as is).

    Returns:
        :class:`FitResult`.

    Raises:
        ValueError: no recorded items on any rank; ``refit`` with several strengths and no held-out items.
    """
    local = torch.tensor([float(len(items)), float(len(heldout or []))], dtype=torch.float64)
    counts = all_reduce(local)
    if float(counts[0]) == 0:
        raise ValueError("empty calibration set: no image reached the layer; give at least one image")
    has_held = float(counts[1]) > 0
    if refit and not has_held and len(refit_regs) != 1:
        raise ValueError("choosing the refit strength needs held-out images (holdout > 0) or a single refit_reg")
    heldout = list(heldout or [])
    variant = layer.variant
    h = layer.num_heads
    alpha0 = softmax_weighted_mean_score(items, all_reduce)
    alpha0 = min(alpha0, 1.0 - 1e-4)
    fit_m = variant in ("latte", "tte_only")
    m0 = math.sqrt(1.0 - alpha0) if fit_m else 1.0
    layer.sigma.fill_(1.0)
    layer.refit_on.fill_(False)
    layer.refit_weight.copy_(torch.eye(layer.embed_dim))
    layer.refit_bias.zero_()
    layer.m.fill_(m0)
    layer.log_rho.fill_(0.0)
    initial = reconstruction_error(layer, items, all_reduce, use_sigma=False)

    total = float(_sum_count([(0.0, float(it.target.numel())) for it in items], all_reduce)[1])
    stacked = _stack_by_shape(items)
    held_total = float(_sum_count([(0.0, float(it.target.numel())) for it in heldout], all_reduce)[1])
    held_stacked = _stack_by_shape(heldout)

    def losses(m: Tensor, log_rho: Tensor) -> Tensor:  # (H,), identical on every rank
        return all_reduce(_head_losses(layer, stacked, m.expand(h), log_rho.expand(h), total).detach().clone())

    def held_loss(m: Tensor, log_rho: Tensor) -> float:
        with torch.no_grad():
            val = _head_losses(layer, held_stacked, m.expand(h), log_rho.expand(h), max(held_total, 1.0)).sum()
        return float(all_reduce(val.detach().reshape(1).clone())[0])

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

    def sanitized() -> tuple[Tensor, Tensor]:
        """Current (m, log_rho); where the line search wandered off (non-finite or worse than
        the grid's best on the fit set), the grid's best instead."""
        with torch.no_grad():
            m_fit = m.detach().abs().clone()
            r_fit = log_rho.detach().clamp(-20.0, 20.0)  # keeps the gauge from drifting to overflow
            fitted = losses(m_fit, r_fit)
            fitted = fitted if per_head else fitted.sum().reshape(1)
            bad = ~torch.isfinite(fitted) | ~torch.isfinite(m_fit) | (fitted > best)
            return torch.where(bad, best_m, m_fit), torch.where(bad, best_r, r_fit)

    step_trace: dict[int, float] = {}
    chosen_m, chosen_r, chosen_steps = best_m.clone(), best_r.clone(), 0
    if has_held:
        step_trace[0] = best_held = held_loss(chosen_m, chosen_r)
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

        checkpoints = sorted({c for c in STEP_CHECKPOINTS if c < steps} | {steps}) if has_held else [steps]
        done = 0
        for c in checkpoints:
            opt.param_groups[0]["max_iter"] = c - done
            opt.param_groups[0]["max_eval"] = (c - done) * 5 // 4
            opt.step(closure)
            done = c
            m_c, r_c = sanitized()
            if has_held:
                step_trace[c] = e = held_loss(m_c, r_c)
                if math.isfinite(e) and e < best_held:
                    best_held, chosen_m, chosen_r, chosen_steps = e, m_c, r_c, c
            else:
                chosen_m, chosen_r, chosen_steps = m_c, r_c, c
    layer.m.copy_(chosen_m.expand(h))
    layer.log_rho.copy_(chosen_r.expand(h))

    # output correction: knobs on held-out items, then the final closed form on all items
    c_dim = layer.embed_dim
    fit_sums = _normal_sums(layer, stacked, all_reduce)
    held_info: dict = {}
    refit_reg = None
    if has_held:
        held_info["steps"] = step_trace
        held_sums = _normal_sums(layer, held_stacked, all_reduce)
        held_info["correction"] = {
            "none": _correction_mse(_identity_w(c_dim), held_sums),
            "sigma": _correction_mse(_identity_w(c_dim, _sigma_from_sums(fit_sums)), held_sums),
        }
        regs = {float(r): _correction_mse(_ridge(fit_sums, float(r)), held_sums) for r in refit_regs}
        regs = {r: (e if math.isfinite(e) else math.inf) for r, e in regs.items()}
        held_info["refit_reg"] = regs
        refit_reg = min(regs, key=lambda r: (regs[r], r))
        held_info["correction"]["refit"] = regs[refit_reg]
        all_sums = _add_sums(fit_sums, held_sums)
    else:
        all_sums = fit_sums
        refit_reg = float(refit_regs[0]) if refit else None
    if refit:
        w = _ridge(all_sums, refit_reg)
        layer.refit_weight.copy_(w[:c_dim].t().float())
        layer.refit_bias.copy_(w[c_dim].float())
        layer.refit_on.fill_(True)
    elif fit_sigma:
        layer.sigma.copy_(_sigma_from_sums(all_sums).float())
    final = reconstruction_error(layer, items, all_reduce, use_sigma=True)
    # the correction used, as fitted on the fit items only: a true held-out error
    held_final = held_info["correction"]["refit" if refit else "sigma" if fit_sigma else "none"] if has_held else None
    layer.calibrated.fill_(True)
    return FitResult(initial_mse=initial, final_mse=final, alpha_init=alpha0, heldout_mse=held_final,
                     steps=chosen_steps, refit_reg=refit_reg if refit else None, heldout=held_info)
