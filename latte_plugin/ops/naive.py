"""The plain references: every score matrix materialised, ``N x M``, nothing fused.

Each fast path in :mod:`latte_plugin.ops.latte` (and the Triton kernel) is tested against the
``naive_`` function of the same contract here. Shapes as in :mod:`latte_plugin.ops`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .masks import additive_mask

__all__ = ["naive_softmax_attention", "naive_jpn_similarity", "naive_linear_attention", "naive_piecewise_attention",
           "naive_similarity_order", "naive_lowrank_similarity_order"]

_EPS = 1e-6


def naive_softmax_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                            attn_mask: Optional[Tensor] = None) -> Tensor:
    """Reference softmax attention (``docs/method.md#softmax``), computed in float64-free plain torch.

    Args:
        q: ``(B, H, N, d)``.
        k: ``(B, H, M, d)``.
        v: ``(B, H, M, d_v)``.
        key_padding_mask: ``(B, M)`` bool, ``True`` = padded key.
        attn_mask: ``(N, M)`` or ``(B, H, N, M)``; bool (``True`` = masked) or additive.

    Returns:
        ``(B, H, N, d_v)``. A row whose keys are all masked returns zeros.
    """
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    bias = additive_mask(key_padding_mask, attn_mask, scores.dtype)
    if bias is not None:
        scores = scores + bias
    # A fully masked row has max -inf; define its output as zeros instead of NaN.
    row_max = scores.amax(dim=-1, keepdim=True)
    dead = torch.isinf(row_max) & (row_max < 0)
    scores = scores - torch.where(dead, torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return weights @ v


def naive_jpn_similarity(
    fq: Tensor, fk: Tensor, delta_q: float, delta_k: float, eps: float = _EPS
) -> Tensor:
    """JPN in the paper's joint form ``delta_q delta_k <q2, k2> / h'(q, k)^2``: ``(..., N, M)``.

    Reference for :func:`jpn_normalize`; ``fq`` is ``(..., N, F)``, ``fk`` is ``(..., M, F)``.
    """
    h2 = (fq.norm(dim=-1, keepdim=True) + eps) * (fk.norm(dim=-1, keepdim=True) + eps).transpose(-1, -2)
    return delta_q * delta_k * (fq @ fk.transpose(-1, -2)) / h2


def naive_linear_attention(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
) -> Tensor:
    """Reference kernel attention with the full score matrix ``S = fq fk^T``.

    It is also the path for a general (e.g. causal) mask, which the factorised
    :func:`linear_attention` cannot honour: masked pairs get zero weight in both sums.

    Args:
        fq: ``(B, H, N, F)`` non-negative-score features; fk: ``(B, H, M, F)``; v: ``(B, H, M, d_v)``.
        key_padding_mask: ``(B, M)``, ``True`` = padded key (removed from both sums).
        attn_mask: bool, broadcastable to ``(B, H, N, M)``, ``True`` = masked pair.

    Returns:
        ``(B, H, N, d_v)``; rows with no valid key return zeros.
    """
    scores = fq @ fk.transpose(-1, -2)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask, 0.0)
    denom = scores.sum(dim=-1, keepdim=True)
    return (scores @ v) / torch.where(denom != 0, denom, torch.ones_like(denom))


def _naive_key_blocks(k: Tensor, v: Tensor, valid: Tensor, spec) -> tuple:
    """Every key's block and the blocks' sums: ``(block of each key (B, H, M), counts (B, H, nK),
    mean keys (B, H, nK, d), value sums (B, H, nK, d_v))``."""
    from .piecewise import token_groups

    kgroup, nk = token_groups(k, valid, spec.block, spec.order)
    onehot = torch.nn.functional.one_hot(kgroup, nk).to(k.dtype) * valid[:, None, :, None].to(k.dtype)
    counts = onehot.sum(dim=2)
    kbar = (onehot.transpose(-1, -2) @ k) / counts.clamp_min(1).unsqueeze(-1)
    return kgroup, counts, kbar, onehot.transpose(-1, -2) @ v


def _naive_rest_values(q, k, v, blocks, rest_k, weights, spec, latte) -> Tensor:
    """The rest's numerator written out per key, given ``blocks`` ``(mean keys, block of each key)``,
    the rest keys of each query ``rest_k`` ``(B, H, N, M)``, the rest's mass ``weights``
    ``(r_den (B, H, N, 1), w (B, H, N, nK), vsum, n_rest)`` and LATTE's ``(m, rho)``."""
    from .piecewise import psi_unit

    (kbar, kgroup), (r_den, w, vsum, n_rest), (m, rho) = blocks, weights, latte
    d = q.shape[-1]
    if spec.rest == "blockmean":
        centred = k - torch.gather(kbar, 2, kgroup.unsqueeze(-1).expand_as(k))  # rest_k drops padded keys
        # sum over a query's rest keys of (q . (k_l - kbar of l's block)) v_l
        first = ((q @ centred.transpose(-1, -2)) * rest_k) @ v / math.sqrt(d)
        return spec.gamma * (w @ vsum) + r_den / n_rest.clamp_min(1) * first
    fq = psi_unit(q, m) * torch.as_tensor(rho, dtype=q.dtype, device=q.device)
    kern = (fq @ psi_unit(k, m).transpose(-1, -2) + 1.0) * rest_k  # (B, H, N, M)
    lden = kern.sum(-1, keepdim=True)
    return r_den * (kern @ v) / torch.where(lden > 0, lden, torch.ones_like(lden))


def naive_piecewise_attention(q: Tensor, k: Tensor, v: Tensor, spec, m: Tensor | float = 1.0,
                              rho: Tensor | float = 1.0, key_padding_mask: Optional[Tensor] = None,
                              q_pool: Optional[Tensor] = None) -> Tensor:
    """Reference piecewise attention (``docs/method.md#piecewise``) with the full ``N x M`` score
    matrix: the same blocks (``token_groups``) and block choice, then every term written out per
    key and per block.

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``.
        spec, m, rho, key_padding_mask: as in :func:`latte_plugin.ops.piecewise.piecewise_attention`.
        q_pool: ``(B, H, N, d)``, each query's pooled query (the mean of its block); default: the
            means of ``q``'s own blocks. Calibration records a sample of the queries and passes the
            means of their full blocks here.

    Returns:
        ``(B, H, N, d_v)`` in ``v``'s dtype.
    """
    acc = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    out_dtype = v.dtype
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    b, h, n, d = q.shape
    mlen = k.shape[-2]
    valid = torch.ones(b, mlen, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    kgroup, counts, kbar, vsum = _naive_key_blocks(k, v, valid, spec)
    from .piecewise import pooled_queries

    q_pool = pooled_queries(q, spec.block, spec.order) if q_pool is None else q_pool.to(acc)
    pooled = (q_pool @ kbar.transpose(-1, -2) / math.sqrt(d)).masked_fill((counts == 0).unsqueeze(-2), float("-inf"))
    idx = torch.topk(pooled, min(int(spec.top), kbar.shape[2]), dim=-1).indices
    chosen_b = torch.zeros_like(pooled, dtype=torch.bool).scatter(-1, idx, True)  # (B, H, N, nK)
    in_chosen = torch.gather(chosen_b, 3, kgroup.unsqueeze(2).expand(b, h, n, mlen))  # (B, H, N, M)
    chosen_k, rest_k = in_chosen & valid[:, None, None, :], ~in_chosen & valid[:, None, None, :]
    rest_b = ~chosen_b & (counts > 0).unsqueeze(-2)
    x, y = (q @ k.transpose(-1, -2)) / math.sqrt(d), (q @ kbar.transpose(-1, -2)) / math.sqrt(d)
    mx = torch.maximum(x.masked_fill(~chosen_k, float("-inf")).amax(-1), y.masked_fill(~rest_b, float("-inf")).amax(-1))
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1)
    # masked before exp: a key outside the chosen blocks may score far above mx (exp would overflow)
    e = torch.exp((x - mx).masked_fill(~chosen_k, float("-inf")))
    w = torch.exp((y - mx).masked_fill(~rest_b, float("-inf")))
    r_den = spec.gamma * (w * counts.unsqueeze(-2)).sum(-1, keepdim=True)
    n_rest = (rest_b * counts.unsqueeze(-2)).sum(-1, keepdim=True)
    r_num = _naive_rest_values(q, k, v, (kbar, kgroup), rest_k, (r_den, w, vsum, n_rest), spec, (m, rho))
    den = e.sum(-1, keepdim=True) + r_den
    return ((e @ v + r_num) / torch.where(den > 0, den, torch.ones_like(den))).to(out_dtype)


def naive_similarity_order(x: Tensor, valid: Tensor, groups: int, iters: int = 4) -> Tensor:
    """A permutation that puts similar tokens together: ``log2(groups)`` rounds of bisection, each
    group split at the median of its projection on its principal direction (power iteration from
    a fixed start: deterministic), invalid tokens last. Balanced: every group gets the same number
    of slots. The reference of :func:`latte_plugin.ops.token_order.similarity_order`: the power
    iteration as ``c^T (c v)`` over the tokens, each round gathered from ``x`` afresh.

    Args:
        x: ``(B, H, L, d)`` with ``L`` a multiple of ``groups``; valid: ``(B, H|1, L)`` bool.

    Returns:
        ``(B, H, L)`` int64: sorted position -> original position.
    """
    b, h, length, d = x.shape
    valid = valid.expand(b, h, length)
    perm = torch.arange(length, device=x.device).expand(b, h, length)
    start = (1.0 + torch.arange(d, device=x.device, dtype=x.dtype) / d).view(1, 1, 1, d, 1)
    g = 1
    while g < groups:
        xs = torch.gather(x, 2, perm.unsqueeze(-1).expand(b, h, length, d)).view(b, h, g, length // g, d)
        ok = torch.gather(valid, 2, perm).view(b, h, g, length // g, 1).to(x.dtype)
        mean = (xs * ok).sum(-2, keepdim=True) / ok.sum(-2, keepdim=True).clamp_min(1.0)
        c = (xs - mean) * ok
        vec = start.expand(b, h, g, d, 1)
        for _ in range(iters):
            vec = c.transpose(-1, -2) @ (c @ vec)
            vec = vec / torch.linalg.vector_norm(vec, dim=-2, keepdim=True).clamp_min(1e-30)
        proj = (c @ vec).squeeze(-1).masked_fill(ok.squeeze(-1) == 0, float("inf"))
        order = torch.topk(proj, proj.shape[-1], dim=-1, largest=False).indices  # an ascending sort (ONNX TopK)
        perm = torch.gather(perm.reshape(b, h, g, length // g), 3, order).reshape(b, h, length)
        g *= 2
    return perm


def naive_lowrank_similarity_order(x: Tensor, valid: Tensor, groups: int, rank: int, iters: int = 4) -> Tensor:
    """The bisection of :func:`naive_similarity_order` on the valid tokens' coordinates along their
    top ``rank`` principal directions. The reference of
    :func:`latte_plugin.ops.token_order.lowrank_similarity_order`: the directions are the right
    singular vectors of the centred tokens (an SVD, not the covariance's eigendecomposition), each
    signed so that its largest-magnitude entry is positive.

    Args:
        x: ``(B, H, L, d)`` with ``L`` a multiple of ``groups``; valid: ``(B, H|1, L)`` bool; rank: < d.

    Returns:
        ``(B, H, L)`` int64: sorted position -> original position.
    """
    b, h, length, d = x.shape
    ok = valid.expand(b, h, length).to(x.dtype).unsqueeze(-1)
    c = (x - (x * ok).sum(-2, keepdim=True) / ok.sum(-2, keepdim=True).clamp_min(1.0)) * ok
    coords = torch.empty(b, h, length, rank, dtype=x.dtype, device=x.device)
    for i in range(b):
        for j in range(h):
            _, _, vh = torch.linalg.svd(c[i, j].double(), full_matrices=False)  # rows: directions, largest first
            top = vh[:rank].flip(0)  # the fast path's column order: ascending variance
            top = top * torch.sign(top.gather(1, top.abs().argmax(1, keepdim=True)))
            coords[i, j] = (c[i, j].double() @ top.T).to(x.dtype)
    return naive_similarity_order(coords, valid, groups, iters)
