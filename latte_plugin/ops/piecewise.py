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
from typing import Optional

import torch
from torch import Tensor

__all__ = ["RESTS", "PIECEWISE_BLOCK", "pool_blocks", "select_key_blocks", "piecewise_attention",
           "piecewise_exact_terms", "piecewise_rest_terms", "merge_terms", "psi_unit"]

#: How the keys outside the chosen blocks are approximated.
RESTS = ("blockmean", "latte")
#: Tokens per block (queries and keys).
PIECEWISE_BLOCK = 64

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
        x: ``(B, H, L, c)`` with ``L`` a multiple of ``block`` (padded). valid: ``(B, L)`` bool.

    Returns:
        ``(means (B, H, L / block, c), counts (B, 1, L / block))``; an empty block's mean is 0.
    """
    b, h, length, c = x.shape
    w = valid.to(x.dtype).view(b, 1, length // block, block, 1)
    sums = (x.view(b, h, length // block, block, c) * w).sum(dim=-2)
    counts = w.sum(dim=(-2, -1))  # (B, 1, nb)
    return sums / counts.clamp_min(1.0).unsqueeze(-1), counts


def select_key_blocks(q_pool: Tensor, k_pool: Tensor, k_counts: Tensor, top: int) -> Tensor:
    """The ``top`` key blocks of highest pooled score for each pooled query (empty blocks last).

    Args:
        q_pool: ``(B, H, P, d)`` pooled queries; k_pool: ``(B, H, nK, d)``; k_counts: ``(B, 1, nK)``.
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


def piecewise_exact_terms(qb: Tensor, kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax sums over the chosen key blocks, relative to their row maximum.

    Args:
        qb: ``(B, H, nQ, block, d)``; kb: ``(B, H, nK, block, d)``; vb: ``(B, H, nK, block, d_v)``;
        validb: ``(B, 1, nK, block)`` bool; idx: ``(B, H, nQ, t)``.

    Returns:
        ``(num (B, H, nQ, block, d_v), den (..., block), row max (..., block))``; a row with no
        valid chosen key has max ``-inf`` and zero sums.
    """
    b, h, nq, block, d = qb.shape
    ks = _gather_blocks(kb, idx).flatten(3, 4)  # (B, H, nQ, t*block, d)
    vs = _gather_blocks(vb, idx).flatten(3, 4)
    ok = _gather_blocks(validb.expand(b, h, *validb.shape[2:]), idx).flatten(3, 4)  # (B, H, nQ, t*block)
    x = (qb @ ks.transpose(-1, -2)) / math.sqrt(d)  # (B, H, nQ, block, t*block)
    x = x.masked_fill(~ok.unsqueeze(-2), float("-inf"))
    mx = x.amax(dim=-1)
    e = torch.exp(x - torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1))
    return e @ vs, e.sum(dim=-1), mx


def piecewise_rest_terms(q: Tensor, kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor, rest: str,
                         m: Tensor | float, rho: Tensor | float, gamma: Tensor | float
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """The approximation of the keys outside the chosen blocks, relative to its own row maximum.

    Args:
        q: ``(B, H, nQ, block, d)``; kb, vb, validb, idx: as in :func:`piecewise_exact_terms`.
        rest: one of :data:`RESTS`. m, rho: LATTE's scalars (``rest='latte'``), per head
            ``(H, 1, 1)`` or scalars. gamma: the mass scale.

    Returns:
        ``(num (B, H, nQ, block, d_v), den (..., block), row max (..., block))``.
    """
    b, h, nq, block, d = q.shape
    nk = kb.shape[2]
    w_valid = validb.to(q.dtype).unsqueeze(-1)  # (B, 1, nK, block, 1)
    counts = w_valid.sum(dim=(-2, -1))  # (B, 1, nK)
    kbar = (kb * w_valid).sum(dim=-2) / counts.clamp_min(1.0).unsqueeze(-1)  # (B, H, nK, d)
    chosen = torch.zeros(b, h, nq, nk, dtype=q.dtype, device=q.device).scatter(-1, idx, 1.0) > 0
    restb = ~chosen & (counts > 0).unsqueeze(-2)  # (B, H, nQ, nK)
    y = (q @ kbar.unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)  # (B, H, nQ, block, nK)
    y = y.masked_fill(~restb.unsqueeze(-2), float("-inf"))
    mx = y.amax(dim=-1)
    w = torch.exp(y - torch.where(torch.isinf(mx), torch.zeros_like(mx), mx).unsqueeze(-1))
    gamma = torch.as_tensor(gamma, dtype=q.dtype, device=q.device)
    den = gamma * (w @ counts.unsqueeze(-1).unsqueeze(2)).squeeze(-1)  # (B, H, nQ, block)
    n_rest = (restb.to(q.dtype) @ counts.unsqueeze(-1)).unsqueeze(-2)  # (B, H, nQ, 1, 1)
    va = vb * w_valid
    if rest == "blockmean":
        vsum = va.sum(dim=-2)  # (B, H, nK, d_v) = n_j vbar_j
        num = gamma * (w @ vsum.unsqueeze(2))
        # first order: C_j = sum_l (k_l - kbar_j) v_l^T = K_j^T V_j - kbar_j (n_j vbar_j)^T
        cj = (kb * w_valid).transpose(-1, -2) @ va - kbar.unsqueeze(-1) @ vsum.unsqueeze(-2)  # (B, H, nK, d, d_v)
        c_rest = cj.sum(dim=2, keepdim=True) - _gather_blocks(cj, idx).sum(dim=3)  # (B, H, nQ, d, d_v)
        per_key = den.unsqueeze(-1) / n_rest.clamp_min(1.0)
        num = num + per_key * (q @ c_rest) / math.sqrt(d)
    elif rest == "latte":
        fq = psi_unit(q, m.unsqueeze(2) if isinstance(m, Tensor) else m)
        fq = fq * (rho.unsqueeze(2) if isinstance(rho, Tensor) else rho)
        fk = psi_unit(kb, m.unsqueeze(2) if isinstance(m, Tensor) else m) * w_valid
        kv = fk.transpose(-1, -2) @ va  # (B, H, nK, d, d_v)
        ksum, vsum = fk.sum(dim=-2), va.sum(dim=-2)  # (B, H, nK, d), (B, H, nK, d_v)
        kv_rest = kv.sum(dim=2, keepdim=True) - _gather_blocks(kv, idx).sum(dim=3)
        ks_rest = ksum.sum(dim=2, keepdim=True) - _gather_blocks(ksum, idx).sum(dim=3)  # (B, H, nQ, d)
        vs_rest = vsum.sum(dim=2, keepdim=True) - _gather_blocks(vsum, idx).sum(dim=3)  # (B, H, nQ, d_v)
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


def _blocked(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], block: int, acc: torch.dtype):
    """Padded, blocked copies in ``acc``: ``qb (B, H, nQ, block, d)``, ``kb``, ``vb``, ``validb (B, 1, nK, block)``,
    and the pooled queries ``(B, H, nQ, d)``."""
    b, h, n, d = q.shape
    mlen = k.shape[-2]
    nq, nk = -(-n // block), -(-mlen // block)
    qp, kp, vp = _pad(q.to(acc), nq * block), _pad(k.to(acc), nk * block), _pad(v.to(acc), nk * block)
    valid_k = torch.ones(b, mlen, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    valid_k = torch.nn.functional.pad(valid_k, (0, nk * block - mlen))
    valid_q = torch.nn.functional.pad(torch.ones(b, n, dtype=torch.bool, device=q.device), (0, nq * block - n))
    q_pool, _ = pool_blocks(qp, valid_q, block)
    return (qp.view(b, h, nq, block, d), kp.view(b, h, nk, block, d), vp.view(b, h, nk, block, -1),
            valid_k.view(b, 1, nk, block), q_pool)


def piecewise_attention(q: Tensor, k: Tensor, v: Tensor, top: int, m: Tensor | float = 1.0, rho: Tensor | float = 1.0,
                        gamma: Tensor | float = 1.0, key_padding_mask: Optional[Tensor] = None,
                        rest: str = "blockmean", block: int = PIECEWISE_BLOCK, backend: str = "eager") -> Tensor:
    """Piecewise attention, the fast path (module docstring).

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``.
        top: exact key blocks per query block (capped at the number of key blocks).
        m, rho: LATTE's scalars for ``rest='latte'`` (scalars or ``(H, 1, 1)``). gamma: the mass scale.
        key_padding_mask: ``(B, M)``, ``True`` = padded. rest: one of :data:`RESTS`. block: tokens per block.
        backend: ``eager``, or ``triton`` for the exact part through :mod:`.triton_piecewise` (where it
            takes the block size and head dims; else eager).

    Returns:
        ``(B, H, N, d_v)`` in ``v``'s dtype; a query with no valid key gets zeros.
    """
    b, h, n, d = q.shape
    acc = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    qb, kb, vb, validb, q_pool = _blocked(q, k, v, key_padding_mask, block, acc)
    k_pool, k_counts = pool_blocks(kb.flatten(2, 3), validb.flatten(1, 3), block)
    idx = select_key_blocks(q_pool, k_pool, k_counts, min(int(top), kb.shape[2]))
    from . import triton_piecewise

    if backend == "triton" and triton_piecewise.supported(block, d, v.shape[-1]):
        rest_terms = piecewise_rest_terms(qb, kb, vb, validb, idx, rest, m, rho, gamma)
        out = triton_piecewise.exact_and_merge(qb, kb, vb, validb, idx, rest_terms)
    else:
        out = merge_terms(piecewise_exact_terms(qb, kb, vb, validb, idx),
                          piecewise_rest_terms(qb, kb, vb, validb, idx, rest, m, rho, gamma))
    return out.flatten(2, 3)[:, :, :n].to(v.dtype)
