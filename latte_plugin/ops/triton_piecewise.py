"""The exact part of piecewise attention and the shared normaliser in one Triton kernel.

:func:`latte_plugin.ops.piecewise.piecewise_attention` with ``backend='triton'`` pools and
chooses the key blocks and computes the rest terms in torch (matmuls of ``O(N M / block)``); this
kernel replaces :func:`~latte_plugin.ops.piecewise.piecewise_exact_terms` and
:func:`~latte_plugin.ops.piecewise.merge_terms`. One program per (batch x head, query block): it
streams the query block's chosen key blocks with an online softmax (running maximum, float32
sums, no score matrix stored), then merges the rest terms under one normaliser. Same results as
the eager functions (tested under ``TRITON_INTERPRET=1``). Takes float32 blocked tensors (the
wrapper has converted 16-bit inputs); block size and head dims: powers of two from 16 to 128.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["available", "supported", "exact_and_merge"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def available() -> bool:
    return triton is not None


def _pow2(x: int) -> bool:
    return 16 <= x <= 128 and x & (x - 1) == 0


def supported(query_block: int, key_block: int, d: int, dv: int) -> bool:
    """Whether the kernel takes these block sizes (one power of two) and head dims."""
    return available() and query_block == key_block and _pow2(key_block) and _pow2(d) and _pow2(dv)


if triton is not None:

    @triton.jit
    def _piecewise_kernel(Q, K, V, VALID, IDX, RNUM, RDEN, RMX, O, n_qblocks, n_kblocks, n_heads, top, scale,
                          BLOCK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr):
        bh = tl.program_id(0)
        qi = tl.program_id(1)
        rows = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        qbase = (bh * n_qblocks + qi) * BLOCK
        q = tl.load(Q + (qbase + rows)[:, None] * D + offs_d[None, :])
        mx = tl.full((BLOCK,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK,), tl.float32)
        acc = tl.zeros((BLOCK, DV), tl.float32)
        for t in range(top):
            j = tl.load(IDX + (bh * n_qblocks + qi) * top + t)
            kbase = (bh * n_kblocks + j) * BLOCK
            k = tl.load(K + (kbase + rows)[:, None] * D + offs_d[None, :])
            v = tl.load(V + (kbase + rows)[:, None] * DV + offs_dv[None, :])
            ok = tl.load(VALID + (bh * n_kblocks + j) * BLOCK + rows) != 0
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            new = tl.maximum(mx, tl.max(s, axis=1))
            safe = tl.where(new == float("-inf"), 0.0, new)
            shrink = tl.exp(mx - safe)  # mx = -inf: 0 (nothing summed yet)
            p = tl.exp(s - safe[:, None])
            den = den * shrink + tl.sum(p, axis=1)
            acc = acc * shrink[:, None] + tl.dot(p, v, input_precision="ieee")
            mx = new
        obase = qbase + rows
        r_num = tl.load(RNUM + obase[:, None] * DV + offs_dv[None, :])
        r_den = tl.load(RDEN + obase)
        r_mx = tl.load(RMX + obase)
        both = tl.maximum(mx, r_mx)
        both = tl.where(both == float("-inf"), 0.0, both)
        se = tl.exp(mx - both)
        sr = tl.exp(r_mx - both)
        num = acc * se[:, None] + r_num * sr[:, None]
        total = den * se + r_den * sr
        out = num / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(O + obase[:, None] * DV + offs_dv[None, :], out)


def exact_and_merge(qb: Tensor, kb: Tensor, vb: Tensor, validb: Tensor, idx: Tensor,
                    rest: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The exact part over the chosen blocks merged with the rest terms (``piecewise_rest_terms``).

    Args:
        qb: ``(B, H, nQ, block, d)``; kb: ``(B, H, nK, block, d)``; vb: ``(B, H, nK, block, d_v)``, float32;
        validb: ``(B, H|1, nK, block)`` bool; idx: ``(B, H, nQ, t)``; rest: ``(num, den, row max)``.

    Returns:
        ``(B, H, nQ, block, d_v)`` float32, as ``merge_terms(piecewise_exact_terms(...), rest)``.
    """
    b, h, nq, block, d = qb.shape
    nk, dv, top = kb.shape[2], vb.shape[-1], idx.shape[-1]
    if not supported(block, kb.shape[3], d, dv):
        raise ValueError(f"the Triton piecewise kernel takes power-of-two block sizes and head dims 16..128; got "
                         f"block={block}, d={d}, d_v={dv}")
    f32 = [x.float().contiguous() for x in (qb, kb, vb, *rest)]
    out = torch.empty(b, h, nq, block, dv, dtype=torch.float32, device=qb.device)
    valid = validb.to(torch.int8).expand(b, h, nk, block).reshape(b * h, nk, block).contiguous()
    _piecewise_kernel[(b * h, nq)](f32[0], f32[1], f32[2], valid, idx.to(torch.int32).contiguous(), f32[3], f32[4],
                                   f32[5], out, nq, nk, h, top, 1.0 / math.sqrt(d), BLOCK=block, D=d, DV=dv)
    return out
