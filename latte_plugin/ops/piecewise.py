"""Piecewise attention: exact softmax on the few key blocks that matter to each query block, an
approximation of the other keys, one shared normaliser (``docs/method.md#piecewise``).

Layout as in :mod:`latte_plugin.ops`: ``q`` ``(B, H, N, d)``, ``k`` ``(B, H, M, d)``, ``v``
``(B, H, M, d_v)``, ``key_padding_mask`` ``(B, M)`` (``True`` = padded). Tokens are cut into
contiguous blocks of ``block`` (the last block of each side may be shorter). For each query block
the ``top`` key blocks with the highest pooled score ``mean(q_block) . mean(k_block) / sqrt(d)``
are attended exactly; every other key block ``j`` enters through its mean key ``kbar_j``:

* its mass ``gamma * n_j * exp(q . kbar_j / sqrt(d))`` (the zeroth-order term; ``gamma`` >= 1,
  calibrated, makes up for ``exp`` of a mean being below the mean of ``exp``);
* its values by one of two ``rest`` rules: ``blockmean``, the block's mean value plus a
  first-order term ``q^T C_rest / sqrt(d)`` (``C_j = sum_l (k_l - kbar_j) v_l^T``) that all the
  rest blocks share, weighted by the rest's mean per-key mass; or ``latte``, the calibrated
  LATTE kernel (``m``, ``rho``) over the rest keys.

The exact part and the rest share one normaliser: ``o = (E_num + R_num) / (E_den + R_den)``.
With ``top`` >= the number of key blocks it is softmax attention. The fast path here builds no
``N x M`` tensor: the chosen key blocks are gathered (``index_select``) and attended with batched
matmuls; the rest costs ``O(N M / block)``. The reference is
:func:`latte_plugin.ops.naive.naive_piecewise_attention`; the Triton kernel of the exact part is
:mod:`latte_plugin.ops.triton_piecewise`. Everything accumulates in float32 or wider.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .token_order import LOWRANK_RANK, ORDERS, lowrank_similarity_order, order_tokens, similarity_groups, similarity_order

__all__ = ["RESTS", "ORDERS", "PIECEWISE_BLOCK", "LOWRANK_RANK", "PiecewiseSpec", "similarity_groups", "similarity_order",
           "lowrank_similarity_order", "order_tokens", "token_groups", "pooled_queries",
           "pool_blocks", "select_key_blocks", "piecewise_attention",
           "piecewise_exact_terms", "fused_exact_terms", "fused_exact_available", "piecewise_rest_terms", "merge_terms", "psi_unit"]

#: How the keys outside the chosen blocks are approximated.
RESTS = ("blockmean", "latte")
#: Tokens per block (queries and keys).
PIECEWISE_BLOCK = 64


@dataclass(frozen=True)
class PiecewiseSpec:
    """The knobs of one piecewise layer.

    Attributes:
        top: exact key blocks per query block (capped at the number of key blocks).
        gamma: the mass scale of the approximated blocks. rest: one of :data:`RESTS`.
        block: tokens per block (about that many with an order other than ``tokens``). order: one of :data:`ORDERS`.
    """

    top: int
    gamma: float = 1.0
    rest: str = "blockmean"
    block: int = PIECEWISE_BLOCK
    order: str = "tokens"

    def __post_init__(self) -> None:
        if int(self.top) < 1 or int(self.block) < 1:
            raise ValueError(f"piecewise top and block must be >= 1, got top={self.top}, block={self.block}")
        if self.rest not in RESTS:
            raise ValueError(f"unknown piecewise rest {self.rest!r}; choose one of {', '.join(RESTS)}")
        if self.order not in ORDERS:
            raise ValueError(f"unknown piecewise order {self.order!r}; choose one of {', '.join(ORDERS)}")

_EPS = 1e-6


def psi_unit(x: Tensor, m: Tensor | float, eps: float = _EPS) -> Tensor:
    """LATTE's normalised feature ``psi_m(x) / ||psi_m(x)||`` (``docs/method.md#jpn``): ``(..., d)``."""
    f = (x * x.shape[-1] ** -0.25 + m) ** 2
    return f / (torch.linalg.vector_norm(f, dim=-1, keepdim=True) + eps)


def _pad(x: Tensor, length: int) -> Tensor:
    """``x`` ``(B, H, L, c)`` padded with zeros to ``length`` tokens."""
    extra = length - x.shape[-2]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0, 0, extra))


def pool_blocks(x: Tensor, valid: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Block means over the valid tokens.

    Args:
        x: ``(B, H, L, c)`` with ``L`` a multiple of ``block`` (padded). valid: ``(B, H|1, L)`` bool.

    Returns:
        ``(means (B, H, L / block, c), counts (B, H|1, L / block))``; an empty block's mean is 0.
    """
    b, h, length, c = x.shape
    w = valid.to(x.dtype).view(b, valid.shape[1], length // block, block, 1)
    sums = (x.view(b, h, length // block, block, c) * w).sum(dim=-2)
    counts = w.sum(dim=(-2, -1))  # (B, H|1, nb)
    return sums / counts.clamp_min(1.0).unsqueeze(-1), counts


def select_key_blocks(q_pool: Tensor, k_pool: Tensor, k_counts: Tensor, top: int) -> Tensor:
    """The ``top`` key blocks of highest pooled score for each pooled query (empty blocks last).

    Args:
        q_pool: ``(B, H, P, d)`` pooled queries; k_pool: ``(B, H, nK, d)``; k_counts: ``(B, H|1, nK)``.
        top: blocks kept, <= nK.

    Returns:
        ``(B, H, P, top)`` int64 block indices (``torch.topk`` order: highest first).
    """
    scores = q_pool @ k_pool.transpose(-1, -2) / math.sqrt(q_pool.shape[-1])
    scores = scores.masked_fill((k_counts == 0).unsqueeze(-2), float("-inf"))
    return torch.topk(scores, top, dim=-1).indices


def _gather_blocks(x: Tensor, idx: Tensor) -> Tensor:
    """``x`` ``(B, H, nK, ...)`` at ``idx`` ``(B, H, P, t)`` per (batch, head): ``(B, H, P, t, ...)``,
    by one ``index_select`` on the flattened table (ONNX ``Gather``)."""
    b, h, nk = x.shape[:3]
    rest = x.shape[3:]
    offsets = (torch.arange(b * h, device=x.device) * nk).view(b, h, 1, 1)
    flat = x.reshape(b * h * nk, -1).index_select(0, (idx + offsets).reshape(-1))
    return flat.view(*idx.shape, *rest)


def _sum_over(x: Tensor, weights: Tensor) -> Tensor:
    """``sum_j weights[..., p, j] x[..., j, ...]``: ``x`` ``(B, H, nK, ...)``, ``weights`` ``(B, H, P, nK)``
    to ``(B, H, P, ...)``, by one matmul (a gather of every chosen block's table would copy
    ``P x t`` of them; subtracting the chosen ones from the total would cancel)."""
    return (weights @ x.flatten(3)).view(*weights.shape[:3], *x.shape[3:])


def _chosen_keys(kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each query block's chosen key blocks side by side: keys ``(B, H, nQ, S, d)``, values
    ``(B, H, nQ, S, d_v)`` and validity ``(B, H, nQ, S)``, ``S = t * block`` (arguments as in
    :func:`piecewise_exact_terms`)."""
    b, h = kb.shape[:2]
    ok = _gather_blocks(validb.expand(b, h, *validb.shape[2:]), idx).flatten(3, 4)
    return _gather_blocks(kb, idx).flatten(3, 4), _gather_blocks(vb, idx).flatten(3, 4), ok


def piecewise_exact_terms(qb: Tensor, kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax sums over the chosen key blocks, relative to their row maximum.

    Args:
        qb: ``(B, H, nQ, block, d)``; kb: ``(B, H, nK, block, d)``; vb: ``(B, H, nK, block, d_v)``;
        validb: ``(B, H|1, nK, block)`` bool; idx: ``(B, H, nQ, t)``.

    Returns:
        ``(num (B, H, nQ, block, d_v), den (..., block), row max (..., block))``; a row with no
        valid chosen key has max ``-inf`` and zero sums.
    """
    d = qb.shape[-1]
    ks, vs, ok = _chosen_keys(kb, vb, validb, idx)
    x = (qb @ ks.transpose(-1, -2)) / math.sqrt(d)  # (B, H, nQ, block, t*block)
    x = x.masked_fill(~ok.unsqueeze(-2), float("-inf"))
    mx = x.amax(dim=-1)
    e = torch.exp(x - torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1))
    return e @ vs, e.sum(dim=-1), mx


def fused_exact_available(x: Tensor, v: Tensor) -> bool:
    """Whether :func:`fused_exact_terms` can run on queries ``x`` and values ``v``: CPU tensors with
    one head size (the kernel's limit), no autograd, no trace or export (the op is an ATen internal
    that ONNX does not have), and this torch ships the op."""
    return (x.device.type == "cpu" and x.shape[-1] == v.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or v.requires_grad))
            and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export()
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def fused_exact_terms(qb: Tensor, kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`piecewise_exact_terms` through PyTorch's CPU flash-attention kernel, which fuses the
    scores, their exponentials and both sums and returns each row's log-sum-exp.

    The terms come back in another but equivalent scale: the normalised output as the numerator,
    a denominator of 1 and the log-sum-exp as the row "maximum", so that :func:`merge_terms`
    rescales them by ``exp(lse - mx) = den / exp(mx)`` exactly as it rescales the plain ones.

    Args/Returns: as :func:`piecewise_exact_terms` (a query block with no valid chosen key: zero
    numerator, ``-inf`` log-sum-exp).
    """
    b, h, nq, block, d = qb.shape
    ks, vs, ok = _chosen_keys(kb, vb, validb, idx)
    rows, span = b * h * nq, ks.shape[3]
    bias = None
    if not bool(ok.all()):
        bias = torch.zeros(ok.shape, dtype=qb.dtype, device=qb.device).masked_fill_(~ok, float("-inf"))
        bias = bias.view(rows, 1, 1, span)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb.reshape(rows, 1, block, d), ks.reshape(rows, 1, span, d), vs.reshape(rows, 1, span, -1), attn_mask=bias)
    empty = ~ok.any(dim=-1, keepdim=True)  # (B, H, nQ, 1): every chosen key padded
    out = out.view(b, h, nq, block, -1).masked_fill(empty.unsqueeze(-1), 0.0)
    lse = lse.view(b, h, nq, block).masked_fill(empty, float("-inf"))
    return out, torch.ones_like(lse), lse


def _over_blocks(x: Tensor | float) -> Tensor | float:
    """A per-head ``(H, 1, 1)`` scalar broadcast over blocked ``(B, H, nB, block, d)`` tensors."""
    return x.unsqueeze(2) if isinstance(x, Tensor) and x.dim() == 3 else x


def piecewise_rest_terms(q: Tensor, kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor, spec: PiecewiseSpec,
                         m: Tensor | float, rho: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
    """The approximation of the keys outside the chosen blocks, relative to its own row maximum.

    Args:
        q: ``(B, H, nQ, block, d)``; kb, vb, validb, idx: as in :func:`piecewise_exact_terms`.
        spec: the layer's knobs (``rest``, ``gamma``). m, rho: LATTE's scalars (``rest='latte'``),
            per head ``(H, 1, 1)`` or scalars.

    Returns:
        ``(num (B, H, nQ, block, d_v), den (..., block), row max (..., block))``.
    """
    b, h, nq, block, d = q.shape
    nk = kb.shape[2]
    w_valid = validb.to(q.dtype).unsqueeze(-1)  # (B, H|1, nK, block, 1)
    counts = w_valid.sum(dim=(-2, -1))  # (B, H|1, nK)
    kbar = (kb * w_valid).sum(dim=-2) / counts.clamp_min(1.0).unsqueeze(-1)  # (B, H, nK, d)
    chosen = torch.zeros(b, h, nq, nk, dtype=q.dtype, device=q.device).scatter(-1, idx, 1.0) > 0
    restb = ~chosen & (counts > 0).unsqueeze(-2)  # (B, H, nQ, nK)
    unchosen = (~chosen).to(q.dtype)  # empty blocks add zeros to every sum below
    y = (q @ kbar.unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)  # (B, H, nQ, block, nK)
    y = y.masked_fill(~restb.unsqueeze(-2), float("-inf"))
    mx = y.amax(dim=-1)
    w = torch.exp(y - torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1))
    rest, gamma = spec.rest, torch.as_tensor(spec.gamma, dtype=q.dtype, device=q.device)
    den = gamma * (w @ counts.unsqueeze(-1).unsqueeze(2)).squeeze(-1)  # (B, H, nQ, block)
    n_rest = (restb.to(q.dtype) @ counts.unsqueeze(-1)).unsqueeze(-2)  # (B, H, nQ, 1, 1)
    va = vb * w_valid
    if rest == "blockmean":
        vsum = va.sum(dim=-2)  # (B, H, nK, d_v) = n_j vbar_j
        num = gamma * (w @ vsum.unsqueeze(2))
        # first order: C_j = sum_l (k_l - kbar_j) v_l^T = K_j^T V_j - kbar_j (n_j vbar_j)^T
        cj = (kb * w_valid).transpose(-1, -2) @ va - kbar.unsqueeze(-1) @ vsum.unsqueeze(-2)  # (B, H, nK, d, d_v)
        c_rest = _sum_over(cj, unchosen)  # (B, H, nQ, d, d_v)
        per_key = den.unsqueeze(-1) / n_rest.clamp_min(1.0)
        num = num + per_key * (q @ c_rest) / math.sqrt(d)
    elif rest == "latte":
        m, rho = _over_blocks(m), _over_blocks(rho)
        fq = psi_unit(q, m) * rho
        fk = psi_unit(kb, m) * w_valid
        kv = fk.transpose(-1, -2) @ va  # (B, H, nK, d, d_v)
        ksum, vsum = fk.sum(dim=-2), va.sum(dim=-2)  # (B, H, nK, d), (B, H, nK, d_v)
        kv_rest = _sum_over(kv, unchosen)  # (B, H, nQ, d, d_v)
        ks_rest, vs_rest = _sum_over(ksum, unchosen), _sum_over(vsum, unchosen)  # (B, H, nQ, d), (B, H, nQ, d_v)
        lnum = fq @ kv_rest + vs_rest.unsqueeze(-2)
        lden = (fq @ ks_rest.unsqueeze(-1)) + n_rest.squeeze(-1).unsqueeze(-1)  # (B, H, nQ, block, 1)
        num = den.unsqueeze(-1) * lnum / torch.where(lden > 0, lden, torch.ones_like(lden))
    else:
        raise ValueError(f"unknown piecewise rest {rest!r}; choose one of {', '.join(RESTS)}")
    return num, den, mx


def merge_terms(exact: tuple[Tensor, Tensor, Tensor], rest: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The shared normaliser: both parts rescaled to the larger row maximum, ``(..., block, d_v)``."""
    (e_num, e_den, e_mx), (r_num, r_den, r_mx) = exact, rest
    mx = torch.maximum(e_mx, r_mx)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    se = torch.exp(e_mx - mx).nan_to_num(0.0)  # -inf - finite -> 0; both -inf -> exp(nan) -> 0
    sr = torch.exp(r_mx - mx).nan_to_num(0.0)
    num = e_num * se.unsqueeze(-1) + r_num * sr.unsqueeze(-1)
    den = (e_den * se + r_den * sr).unsqueeze(-1)
    return num / torch.where(den > 0, den, torch.ones_like(den))


def token_groups(x: Tensor, valid: Optional[Tensor], block: int, order: str) -> tuple[Tensor, int]:
    """The block of every token, as the fast path forms them: ``((B, H, L) int64, number of blocks)``.

    Args:
        x: ``(B, H, L, d)``; valid: ``(B, L)`` bool or ``None`` (all valid); block, order: as in
            :func:`piecewise_attention`.
    """
    b, h, length, _ = x.shape
    groups, size = similarity_groups(length, block, order)
    if order == "tokens":
        return (torch.arange(length, device=x.device) // block).expand(b, h, length), groups
    ok = torch.ones(b, length, dtype=torch.bool, device=x.device) if valid is None else valid
    ok = torch.nn.functional.pad(ok, (0, groups * size - length)).unsqueeze(1)
    perm = order_tokens(_pad(x, groups * size), ok, groups, order)
    slot = (torch.arange(groups * size, device=x.device) // size).expand_as(perm)
    return torch.empty_like(perm).scatter_(2, perm, slot)[..., :length], groups


def pooled_queries(q: Tensor, block: int, order: str) -> Tensor:
    """Each query's block mean, the blocks formed as :func:`token_groups` forms them: ``(B, H, N, d)``."""
    groups, count = token_groups(q, None, block, order)
    hot = torch.nn.functional.one_hot(groups, count).to(q.dtype)  # (B, H, N, nQ)
    return hot @ (hot.transpose(-1, -2) @ q / hot.sum(-2).clamp_min(1).unsqueeze(-1))


def _take(x: Tensor, perm: Tensor) -> Tensor:
    """``x`` ``(B, H, L, c)`` at ``perm`` ``(B, H, L)`` along the tokens (whole rows: ``index_select``)."""
    b, h, length, c = x.shape
    offsets = (torch.arange(b * h, device=x.device) * length).view(b, h, 1)
    return x.reshape(b * h * length, c).index_select(0, (perm + offsets).reshape(-1)).view(b, h, length, c)


def _inverse(perm: Tensor) -> Tensor:
    """The inverse of a permutation ``(B, H, L)`` along its last axis."""
    return torch.empty_like(perm).scatter_(2, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm))


def _blocked(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], block: int, acc: torch.dtype,
             order: str = "tokens"):
    """Padded, blocked copies in ``acc``: ``qb (B, H, nQ, S, d)``, ``kb``, ``vb``, ``validb (B, H|1, nK, S)``,
    the pooled queries ``(B, H, nQ, d)`` and the queries' permutation (``None`` in token order)."""
    b, h, n, d = q.shape
    mlen = k.shape[-2]
    nq, sq = similarity_groups(n, block, order)
    nk, sk = similarity_groups(mlen, block, order)
    qp, kp, vp = _pad(q.to(acc), nq * sq), _pad(k.to(acc), nk * sk), _pad(v.to(acc), nk * sk)
    valid_k = torch.ones(b, mlen, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    valid_k = torch.nn.functional.pad(valid_k, (0, nk * sk - mlen)).unsqueeze(1)  # (B, 1, Mp)
    valid_q = torch.nn.functional.pad(torch.ones(b, n, dtype=torch.bool, device=q.device), (0, nq * sq - n))
    valid_q = valid_q.unsqueeze(1)
    qperm = None
    if order != "tokens":
        qperm, kperm = order_tokens(qp, valid_q, nq, order), order_tokens(kp, valid_k, nk, order)
        qp, kp, vp = _take(qp, qperm), _take(kp, kperm), _take(vp, kperm)
        valid_q = torch.gather(valid_q.expand(b, h, -1), 2, qperm)
        valid_k = torch.gather(valid_k.expand(b, h, -1), 2, kperm)
    q_pool, _ = pool_blocks(qp, valid_q, sq)
    return (qp.view(b, h, nq, sq, d), kp.view(b, h, nk, sk, d), vp.view(b, h, nk, sk, -1),
            valid_k.view(b, valid_k.shape[1], nk, sk), q_pool, qperm)


def piecewise_attention(q: Tensor, k: Tensor, v: Tensor, spec: PiecewiseSpec, m: Tensor | float = 1.0,
                        rho: Tensor | float = 1.0, key_padding_mask: Optional[Tensor] = None,
                        backend: str = "eager") -> Tensor:
    """Piecewise attention, the fast path (module docstring).

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``.
        spec: the knobs (:class:`PiecewiseSpec`).
        m, rho: LATTE's scalars for ``rest='latte'`` (scalars or ``(H, 1, 1)``).
        key_padding_mask: ``(B, M)``, ``True`` = padded.
        backend: ``eager`` (on CPU, the exact part through PyTorch's fused kernel where
            :func:`fused_exact_available` and at least two key blocks are exact), ``plain`` (the exact part as plain tensor ops: the
            composition the fused kernel is tested against), or ``triton`` for the exact part through
            :mod:`.triton_piecewise` (where it takes the block size and head dims; else eager).

    Returns:
        ``(B, H, N, d_v)`` in ``v``'s dtype; a query with no valid key gets zeros.
    """
    b, h, n, d = q.shape
    acc = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    qb, kb, vb, validb, q_pool, qperm = _blocked(q, k, v, key_padding_mask, spec.block, acc, spec.order)
    k_pool, k_counts = pool_blocks(kb.flatten(2, 3), validb.flatten(2, 3), kb.shape[3])
    idx = select_key_blocks(q_pool, k_pool, k_counts, min(int(spec.top), kb.shape[2]))
    from . import triton_piecewise

    if backend == "triton" and triton_piecewise.supported(qb.shape[3], kb.shape[3], d, v.shape[-1]):
        rest_terms = piecewise_rest_terms(qb, kb, vb, validb, idx, spec, m, rho)
        out = triton_piecewise.exact_and_merge(qb, kb, vb, validb, idx, rest_terms)
    else:
        # the fused kernel pays off from two key blocks a query block (measured on 2 cores: 13% at @8,
        # even at @2, 2-12% slower at @1, where its per-call overhead meets one small block)
        fused = backend == "eager" and idx.shape[-1] >= 2 and fused_exact_available(qb, vb)
        exact = fused_exact_terms if fused else piecewise_exact_terms
        out = merge_terms(exact(qb, kb, vb, validb, idx), piecewise_rest_terms(qb, kb, vb, validb, idx, spec, m, rho))
    out = out.flatten(2, 3)
    if qperm is not None:  # back to the token order
        out = _take(out, _inverse(qperm))
    return out[:, :, :n].to(v.dtype)
