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

__all__ = ["naive_softmax_attention", "naive_jpn_similarity", "naive_linear_attention"]

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
