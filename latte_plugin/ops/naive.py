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

__all__ = ["naive_softmax_attention", "naive_jpn_similarity", "naive_linear_attention", "naive_piecewise_attention"]

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


def _block_of(length: int, block: int, device) -> Tensor:
    """``(L,)`` the block index of each token."""
    return torch.arange(length, device=device) // block


def naive_piecewise_attention(q: Tensor, k: Tensor, v: Tensor, top: int, m: Tensor | float = 1.0,
                              rho: Tensor | float = 1.0, gamma: Tensor | float = 1.0,
                              key_padding_mask: Optional[Tensor] = None, rest: str = "blockmean", block: int = 64,
                              q_pool: Optional[Tensor] = None) -> Tensor:
    """Reference piecewise attention (``docs/method.md#piecewise``) with the full ``N x M`` score
    matrix: the same block choice, then every term written out per key and per block.

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``.
        top, m, rho, gamma, key_padding_mask, rest, block: as in
            :func:`latte_plugin.ops.piecewise.piecewise_attention`.
        q_pool: ``(B, H, N, d)``, each query's pooled query (the mean of its block); default: the
            means of ``q``'s own contiguous blocks. Calibration records a sample of the queries and
            passes the means of their full blocks here.

    Returns:
        ``(B, H, N, d_v)`` in ``v``'s dtype.
    """
    acc = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    out_dtype = v.dtype
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    b, h, n, d = q.shape
    mlen, dev = k.shape[-2], q.device
    valid = torch.ones(b, mlen, dtype=torch.bool, device=dev) if key_padding_mask is None else ~key_padding_mask
    kblock = _block_of(mlen, block, dev)
    nk = int(kblock[-1]) + 1
    onehot = torch.nn.functional.one_hot(kblock, nk).to(acc) * valid.to(acc).unsqueeze(-1)  # (B, M, nK)
    counts = onehot.sum(dim=1)  # (B, nK)
    kbar = (onehot.transpose(1, 2).unsqueeze(1) @ k) / counts.clamp_min(1)[:, None, :, None]  # (B, H, nK, d)
    vsum = onehot.transpose(1, 2).unsqueeze(1) @ v  # (B, H, nK, d_v)
    if q_pool is None:
        qblock = _block_of(n, block, dev)
        qhot = torch.nn.functional.one_hot(qblock, int(qblock[-1]) + 1).to(acc)  # (N, nQ)
        q_pool = (qhot.t() @ q / qhot.sum(0)[:, None])[..., qblock, :]  # (B, H, N, d)
    pooled = (q_pool.to(acc) @ kbar.transpose(-1, -2)) / math.sqrt(d)  # (B, H, N, nK)
    pooled = pooled.masked_fill((counts == 0)[:, None, None, :], float("-inf"))
    idx = torch.topk(pooled, min(int(top), nk), dim=-1).indices
    chosen_b = torch.zeros_like(pooled, dtype=torch.bool).scatter(-1, idx, True)  # (B, H, N, nK)
    chosen_k = chosen_b[..., kblock] & valid[:, None, None, :]  # (B, H, N, M)
    rest_b = ~chosen_b & (counts > 0)[:, None, None, :]
    rest_k = ~chosen_b[..., kblock] & valid[:, None, None, :]
    x = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    y = (q @ kbar.transpose(-1, -2)) / math.sqrt(d)
    mx = torch.maximum(x.masked_fill(~chosen_k, float("-inf")).amax(-1), y.masked_fill(~rest_b, float("-inf")).amax(-1))
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1)
    e = torch.exp(x - mx) * chosen_k
    w = torch.exp(y - mx) * rest_b  # (B, H, N, nK)
    gamma = torch.as_tensor(gamma, dtype=acc, device=dev)
    r_den = gamma * (w * counts[:, None, None, :]).sum(-1, keepdim=True)
    n_rest = (rest_b * counts[:, None, None, :]).sum(-1, keepdim=True)
    if rest == "blockmean":
        r_num = gamma * (w @ vsum)
        centred = (k - kbar[:, :, kblock]) * valid[:, None, :, None]  # (B, H, M, d): k_l - kbar of its block
        # sum over rest keys of (q . (k_l - kbar_j)) v_l, for each query: its own rest keys
        first = ((q @ centred.transpose(-1, -2)) * rest_k) @ v / math.sqrt(d)
        r_num = r_num + r_den / n_rest.clamp_min(1) * first
    elif rest == "latte":
        from .piecewise import psi_unit

        fq = psi_unit(q, m) * torch.as_tensor(rho, dtype=acc, device=dev)
        fk = psi_unit(k, m)
        kern = (fq @ fk.transpose(-1, -2) + 1.0) * rest_k  # (B, H, N, M)
        lden = kern.sum(-1, keepdim=True)
        r_num = r_den * (kern @ v) / torch.where(lden > 0, lden, torch.ones_like(lden))
    else:
        raise ValueError(f"unknown piecewise rest {rest!r}")
    num = e @ v + r_num
    den = e.sum(-1, keepdim=True) + r_den
    return (num / torch.where(den > 0, den, torch.ones_like(den))).to(out_dtype)
