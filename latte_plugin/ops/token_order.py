"""How a piecewise layer forms its blocks: the token orders (``docs/method.md#piecewise``).

``tokens`` keeps consecutive tokens together; ``similarity`` and ``lowrank`` permute each input's
tokens so that similar ones share a block, by balanced bisection. Layout as in
:mod:`latte_plugin.ops`: ``x`` ``(B, H, L, d)``, ``valid`` ``(B, H|1, L)`` bool. The references are
:func:`latte_plugin.ops.naive.naive_similarity_order` and
:func:`latte_plugin.ops.naive.naive_lowrank_similarity_order`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["ORDERS", "LOWRANK_RANK", "similarity_groups", "similarity_order", "lowrank_similarity_order", "order_tokens"]

#: How tokens form blocks: ``tokens``, consecutive tokens (PISA's blocks); ``similarity``, similar
#: tokens (balanced bisection along principal directions, per input: :func:`similarity_order`),
#: so that a block's mean stands for its members when attention is sharp; ``lowrank``, the same
#: bisection on the tokens' projection onto their top :data:`LOWRANK_RANK` principal directions
#: (:func:`lowrank_similarity_order`: each round reads ``LOWRANK_RANK`` columns instead of ``d``).
#: Appended only: a checkpoint stores the index.
ORDERS = ("tokens", "similarity", "lowrank")
#: Principal directions kept by ``order='lowrank'``.
LOWRANK_RANK = 16


def similarity_groups(length: int, block: int, order: str) -> tuple[int, int]:
    """``(groups, tokens per group)`` of ``length`` tokens: contiguous blocks of ``block`` (``tokens``),
    or a power-of-two number of groups of about ``block`` (``similarity``, ``lowrank``: what bisection splits)."""
    if order == "tokens":
        return -(-length // block), block
    groups = 1 << max(0, round(math.log2(max(length / block, 1.0))))
    return groups, -(-length // groups)


def similarity_order(x: Tensor, valid: Tensor, groups: int, iters: int = 4) -> Tensor:
    """A permutation that puts similar tokens together: ``log2(groups)`` rounds of bisection, each
    group split at the median of its projection on its principal direction (power iteration from
    a fixed start: deterministic), invalid tokens last. Balanced: every group gets the same number
    of slots. The reference is :func:`latte_plugin.ops.naive.naive_similarity_order` (the same
    groups); here each round reads the tokens once for the group's ``d x d`` covariance and once for
    the projection, and gathers whole token rows (``index_select``), so a round costs two passes over
    ``x`` instead of ten.

    Args:
        x: ``(B, H, L, d)`` with ``L`` a multiple of ``groups``; valid: ``(B, H|1, L)`` bool.

    Returns:
        ``(B, H, L)`` int64: sorted position -> original position.
    """
    b, h, length, d = x.shape
    bh = b * h
    ok_all = valid.expand(b, h, length).reshape(bh, length).to(x.dtype)
    rows = (x.reshape(bh, length, d) * ok_all.unsqueeze(-1)).reshape(bh * length, d)  # invalid rows zero, once
    offsets = (torch.arange(bh, device=x.device) * length).unsqueeze(1)  # (BH, 1)
    perm = torch.arange(length, device=x.device).expand(bh, length)
    start = (1.0 + torch.arange(d, device=x.device, dtype=x.dtype) / d).view(1, 1, d, 1)
    g = 1
    while g < groups:
        size = length // g
        xs = rows.index_select(0, (perm + offsets).reshape(-1)).view(bh, g, size, d)
        ok = torch.gather(ok_all, 1, perm).view(bh, g, size, 1)
        mean = xs.sum(-2, keepdim=True) / ok.sum(-2, keepdim=True).clamp_min(1.0)
        c = torch.addcmul(xs, ok, mean, value=-1.0)  # (x - mean) on the valid rows, 0 on the others
        cov = c.transpose(-1, -2) @ c  # (BH, g, d, d): the power iteration c^T (c v) without the tokens
        vec = start.expand(bh, g, d, 1)
        for _ in range(iters):
            vec = cov @ vec
            vec = vec / torch.linalg.vector_norm(vec, dim=-2, keepdim=True).clamp_min(1e-30)
        proj = (c @ vec).squeeze(-1).masked_fill(ok.squeeze(-1) == 0, float("inf"))
        order = torch.topk(proj, size, dim=-1, largest=False).indices  # an ascending sort (ONNX TopK)
        perm = torch.gather(perm.reshape(bh, g, size), 2, order).reshape(bh, length)
        g *= 2
    return perm.reshape(b, h, length)


def lowrank_similarity_order(x: Tensor, valid: Tensor, groups: int, rank: int = LOWRANK_RANK, iters: int = 4) -> Tensor:
    """:func:`similarity_order` on the valid tokens' projection onto their top ``rank`` principal
    directions (one ``d x d`` eigendecomposition per batch and head), so that every round's
    gathers, covariance and projection read ``rank`` columns instead of ``d``. The groups differ
    from the full bisection's where a group's own principal direction leaves that subspace.
    Each direction's sign is fixed (its largest entry positive) so that the groups do not depend on
    the eigensolver's. The reference is :func:`latte_plugin.ops.naive.naive_lowrank_similarity_order`
    (the directions from an SVD of the tokens).

    Args:
        x: ``(B, H, L, d)`` with ``L`` a multiple of ``groups``; valid: ``(B, H|1, L)`` bool.
        rank: directions kept (``rank >= d``: :func:`similarity_order` itself).

    Returns:
        ``(B, H, L)`` int64: sorted position -> original position.
    """
    b, h, length, d = x.shape
    if rank >= d:
        return similarity_order(x, valid, groups, iters)
    if torch.onnx.is_in_onnx_export():
        raise RuntimeError("piecewise order 'lowrank' has no ONNX graph (an eigendecomposition); calibrate with "
                           "piecewise_order='similarity' to export")
    ok = valid.expand(b, h, length).to(x.dtype).unsqueeze(-1)
    mean = (x * ok).sum(-2, keepdim=True) / ok.sum(-2, keepdim=True).clamp_min(1.0)
    c = (x - mean) * ok
    _, vecs = torch.linalg.eigh(c.transpose(-1, -2) @ c)  # ascending eigenvalues
    top = vecs[..., -rank:]  # (B, H, d, rank)
    top = top * _signs(top)
    return similarity_order(c @ top, valid, groups, iters)


def _signs(vecs: Tensor) -> Tensor:
    """``+-1`` per column of ``vecs`` ``(..., d, r)`` making each column's largest-magnitude entry positive."""
    peak = torch.gather(vecs, -2, vecs.abs().argmax(dim=-2, keepdim=True))
    return torch.where(peak < 0, -torch.ones_like(peak), torch.ones_like(peak))


def order_tokens(x: Tensor, valid: Tensor, groups: int, order: str) -> Tensor:
    """The permutation of ``order`` (``similarity`` or ``lowrank``; arguments as in :func:`similarity_order`)."""
    return (lowrank_similarity_order if order == "lowrank" else similarity_order)(x, valid, groups)
