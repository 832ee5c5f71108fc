"""A fused LATTE inference kernel for GPUs (Triton), the fast path of calibrated ``latte`` and
``jpn_only`` layers on CUDA tensors.

Same contract and results as :func:`latte_plugin.ops.latte.fused_latte_attention` (its
eager reference; both are tested against the naive composition). Two launches:

1. ``_kv_kernel``, one program per (batch, head, slice of the keys): streams its keys in
   blocks, builds the normalised LATTE key features ``psi_m(k) / ||psi_m(k)||`` in registers
   (never stored), and accumulates ``K~^T V`` ``(d, d_v)``, ``sum_j k~_j`` ``(d,)``,
   ``sum_j v_j`` ``(d_v,)`` and the count of unpadded keys, all in float32. The key slices
   keep the GPU busy when batch x heads is small; their partial sums (a few KB) are added
   by torch.
2. ``_out_kernel``, one program per (batch, head, block of queries): builds
   ``q~ = psi_m(q) / ||psi_m(q)||`` in registers and writes
   ``(rho q~ (K~^T V) + sum v) / (rho q~ . sum k~ + count)`` in the input dtype (the beta
   column handled analytically, as in the eager path).

16-bit inputs: only values in a safe range enter a 16-bit dot. The normalised features lie in
``[0, 1]``; ``K~^T V`` is divided by its largest entry before the cast; ``rho`` (calibrated
values of 1e5 to 1e7 are common) and that scale are applied in float32 after the dot. Both
the numerator and the denominator use the same rounded features.

Supported: float32, float16, bfloat16; head dims that are powers of two from 16 to 128.
On CPU tensors it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests check it without a GPU (there, bfloat16 inputs take the float32 dot: the interpreter's
bfloat16 ``tl.dot`` is wrong, so the bfloat16 tensor-core dot is checked on a GPU only). ``backend='eager'`` (``LATTE_KERNEL=eager``, read once per layer)
or :func:`set_enabled` forces the eager path.
"""
from __future__ import annotations

import os
from dataclasses import astuple, dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["available", "supported", "set_enabled", "Launch", "triton_latte_attention"]

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

_ENABLED = True
_EPS = 1e-6


def set_enabled(enabled: bool) -> None:
    """Turns the Triton path on or off for this process (a layer's ``backend='eager'`` does so per layer)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def available() -> bool:
    """Whether Triton is installed and the path is not turned off (:func:`set_enabled`)."""
    return triton is not None and _ENABLED


def _pow2_in_range(x: int) -> bool:
    return 16 <= x <= 128 and x & (x - 1) == 0


def supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernel takes these tensors (dtype and head dims); the layer falls back otherwise."""
    return (q.dtype in (torch.float32, torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
            and _pow2_in_range(q.shape[-1]) and _pow2_in_range(v.shape[-1]) and q.dim() == 4)


if triton is not None:

    @triton.jit
    def _features(x, m, scale, eps):
        """``psi_m(x) / (||psi_m(x)|| + eps)`` per row, in float32: ``(rows, d)``."""
        f = x.to(tl.float32) * scale + m
        f = f * f
        norm = tl.sqrt(tl.sum(f * f, axis=1)) + eps
        return f / norm[:, None]

    @triton.jit
    def _kv_kernel(K, V, PAD, M_, KV, KSUM, VSUM, CNT,
                   s_kb, s_kh, s_km, s_kd, s_vb, s_vh, s_vm, s_vd, s_pb, s_pm,
                   n_keys, keys_per_split, n_heads, scale, eps,
                   HAS_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                   LOW_PRECISION_DOT: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // n_heads
        h = pid % n_heads
        m = tl.load(M_ + h)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        first = split * keys_per_split
        last = tl.minimum(first + keys_per_split, n_keys)
        kv = tl.zeros((D, DV), dtype=tl.float32)
        ksum = tl.zeros((D,), dtype=tl.float32)
        vsum = tl.zeros((DV,), dtype=tl.float32)
        cnt = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(first, last, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            valid = offs_m < last
            if HAS_PAD:
                pad = tl.load(PAD + b * s_pb + offs_m * s_pm, mask=valid, other=1)
                valid = valid & (pad == 0)
            k = tl.load(K + b * s_kb + h * s_kh + offs_m[:, None] * s_km + offs_d[None, :] * s_kd,
                        mask=valid[:, None], other=0.0)
            v = tl.load(V + b * s_vb + h * s_vh + offs_m[:, None] * s_vm + offs_dv[None, :] * s_vd,
                        mask=valid[:, None], other=0.0)
            f = tl.where(valid[:, None], _features(k, m, scale, eps), 0.0)
            if LOW_PRECISION_DOT:  # 16-bit inputs: tensor-core dot, float32 accumulation
                # features in [0, 1] round without overflow; the sums below use the rounded ones,
                # so the numerator and the denominator weigh each key the same
                f16 = f.to(v.dtype)
                kv += tl.dot(tl.trans(f16), v)
                f = f16.to(tl.float32)
            else:
                kv += tl.dot(tl.trans(f), v.to(tl.float32), input_precision="ieee")
            ksum += tl.sum(f, axis=0)
            vsum += tl.sum(v.to(tl.float32), axis=0)
            cnt += valid.to(tl.float32)
        slot = pid * tl.num_programs(1) + split
        tl.store(KV + slot * D * DV + offs_d[:, None] * DV + offs_dv[None, :], kv)
        tl.store(KSUM + slot * D + offs_d, ksum)
        tl.store(VSUM + slot * DV + offs_dv, vsum)
        tl.store(CNT + slot, tl.sum(cnt, axis=0))

    @triton.jit
    def _out_kernel(Q, KV, KV_SCALE, KSUM, VSUM, CNT, M_, RHO, O,
                    s_qb, s_qh, s_qn, s_qd, s_ob, s_oh, s_on, s_od,
                    n_queries, n_heads, scale, eps,
                    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // n_heads
        h = pid % n_heads
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        rows = offs_n < n_queries
        q = tl.load(Q + b * s_qb + h * s_qh + offs_n[:, None] * s_qn + offs_d[None, :] * s_qd,
                    mask=rows[:, None], other=0.0)
        # rho (often 1e5..1e7 after calibration) and the size of K~^T V (grows with the key
        # count) are applied in float32 after the dot: no 16-bit operand carries them
        f = _features(q, tl.load(M_ + h), scale, eps)
        rho = tl.load(RHO + h)
        kv = tl.load(KV + pid * D * DV + offs_d[:, None] * DV + offs_dv[None, :])
        if LOW_PRECISION_DOT:
            kv_scale = tl.load(KV_SCALE + pid)  # max |K~^T V| of this (batch, head), or 1
            f16 = f.to(q.dtype)
            num = tl.dot(f16, (kv / kv_scale).to(q.dtype)) * (kv_scale * rho)
            f = f16.to(tl.float32)  # the denominator weighs the same rounded features
        else:
            num = tl.dot(f, kv, input_precision="ieee") * rho
        num += tl.load(VSUM + pid * DV + offs_dv)[None, :]
        den = rho * tl.sum(f * tl.load(KSUM + pid * D + offs_d)[None, :], axis=1) + tl.load(CNT + pid)
        out = num / tl.where(den != 0.0, den, 1.0)[:, None]
        tl.store(O + b * s_ob + h * s_oh + offs_n[:, None] * s_on + offs_dv[None, :] * s_od,
                 out.to(O.dtype.element_ty), mask=rows[:, None])


def _per_head(x, heads: int, device) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=device).reshape(-1).expand(heads).contiguous()


@dataclass(frozen=True)
class Launch:
    """How the two kernels are launched: ``block_m`` keys and ``block_n`` queries per block (powers
    of two), ``splits`` key slices per (batch, head) (default: enough for about 512 programs in all)."""

    block_m: int = 64
    block_n: int = 64
    splits: Optional[int] = None


def triton_latte_attention(q: Tensor, k: Tensor, v: Tensor, m: "Tensor | float", rho: "Tensor | float",
                           key_padding_mask: Optional[Tensor] = None, **launch: Optional[int]) -> Tensor:
    """Fused LATTE attention: the same contract as :func:`~latte_plugin.ops.latte.fused_latte_attention`.

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``; one dtype.
        m: ``sqrt(1 - alpha)`` (1 for ``jpn_only``), a scalar or one per head.
        rho: ``delta_q delta_k / (beta_q beta_k)``, a scalar or one per head.
        key_padding_mask: ``(B, M)`` bool, ``True`` = padded.
        **launch: :class:`Launch` fields by name (``block_m``, ``block_n``, ``splits``).

    Returns:
        ``(B, H, N, d_v)`` in the input dtype.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use latte_plugin.ops.latte.fused_latte_attention")
    if not supported(q, k, v):
        raise ValueError(f"the Triton LATTE kernel takes float32/16/bf16 (one dtype) and power-of-two head dims "
                         f"16..128; got {q.dtype}/{k.dtype}/{v.dtype}, d={q.shape[-1]}, d_v={v.shape[-1]}")
    block_m, block_n, splits, eps = *astuple(Launch(**launch)), _EPS
    b, h, n, d = q.shape
    mk, dv = k.shape[-2], v.shape[-1]
    dev = q.device
    if splits is None:
        splits = max(1, min(triton.cdiv(mk, block_m), triton.cdiv(512, b * h)))
    keys_per_split = triton.cdiv(triton.cdiv(mk, splits), block_m) * block_m
    splits = max(1, triton.cdiv(mk, keys_per_split))
    kv = torch.empty(b * h, splits, d, dv, dtype=torch.float32, device=dev)
    ksum = torch.empty(b * h, splits, d, dtype=torch.float32, device=dev)
    vsum = torch.empty(b * h, splits, dv, dtype=torch.float32, device=dev)
    cnt = torch.empty(b * h, splits, dtype=torch.float32, device=dev)
    out = torch.empty(b, h, n, dv, dtype=v.dtype, device=dev)
    m_h, rho_h = _per_head(m, h, dev), _per_head(rho, h, dev)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else cnt  # dummy pointer
    # 16-bit dots on tensor cores; but Triton 3.5's interpreter computes bfloat16 tl.dot wrongly
    # (numpy has no bfloat16), so there bfloat16 inputs take the float32 dot (the GPU check covers it)
    low = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1")
    scale = float(d) ** -0.25
    _kv_kernel[(b * h, splits)](
        k, v, pad, m_h, kv, ksum, vsum, cnt, *k.stride(), *v.stride(),
        pad.stride(0) if key_padding_mask is not None else 0, pad.stride(1) if key_padding_mask is not None else 0,
        mk, keys_per_split, h, scale, eps, HAS_PAD=key_padding_mask is not None, D=d, DV=dv, BLOCK_M=block_m,
        LOW_PRECISION_DOT=low)
    # the slices' partial sums (fixed order: deterministic)
    kv, ksum, vsum, cnt = kv.sum(1), ksum.sum(1), vsum.sum(1), cnt.sum(1)
    # K~^T V is cast to 16 bits for the tensor-core dot: divided by its largest entry first
    # (it grows with the number of keys and overflows float16 at long N otherwise)
    kv_scale = kv.abs().amax(dim=(1, 2)).clamp_min(1e-30) if low else cnt
    _out_kernel[(b * h, triton.cdiv(n, block_n))](
        q, kv, kv_scale, ksum, vsum, cnt, m_h, rho_h, out, *q.stride(), *out.stride(), n, h, scale, eps,
        D=d, DV=dv, BLOCK_N=block_n, LOW_PRECISION_DOT=low)
    return out
