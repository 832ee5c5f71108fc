"""LATTE attention math, fast paths (the method: ``docs/method.md``).

Every tensor is laid out per head: ``q`` is ``(B, H, N, d)``, ``k`` is ``(B, H, M, d)``,
``v`` is ``(B, H, M, d_v)``. ``key_padding_mask`` is ``(B, M)`` with ``True`` marking a
padded key (the torch / mmcv convention). The plain references are in
:mod:`latte_plugin.ops.naive`; tests compare the two. :func:`latte_attention` picks the
kernel of the linear path with one ``backend`` argument.

Nothing here imports a detection framework.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from .masks import additive_mask

__all__ = ["VARIANTS", "BACKENDS", "softmax_attention", "taylor_exact_feature_map", "taylor_kernel", "psi_diag",
           "qtvit_feature_map", "jpn_normalize", "augment", "variant_features", "linear_attention",
           "uniform_attention", "fused_latte_attention", "compiled_fused_latte_attention", "latte_attention",
           "resolve_backend"]

#: The four variants (``docs/method.md#variants``), by name.
VARIANTS = ("qtvit", "jpn_only", "tte_only", "latte")


_EPS = 1e-6


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                      attn_mask: Optional[Tensor] = None) -> Tensor:
    """Fast softmax attention through ``scaled_dot_product_attention``; same contract as the naive one.

    Fully masked rows return zeros, as in :func:`naive_softmax_attention`.
    """
    bias = additive_mask(key_padding_mask, attn_mask, q.dtype)
    if bias is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    dead = torch.isinf(bias).all(dim=-1, keepdim=True)  # (B, 1|H, 1|N, 1)
    safe_bias = torch.where(dead, torch.zeros_like(bias), bias)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=safe_bias)
    return out.masked_fill(dead, 0.0) if bool(dead.any()) else out


# ----------------------------------------------------------------------------- feature maps


def taylor_kernel(x: Tensor, alpha: float | Tensor) -> Tensor:
    """The TTE kernel ``kappa_alpha(x) = (x + 1 - alpha)^2 + 1`` (``docs/method.md#tte``), >= 1."""
    return (x + 1.0 - alpha) ** 2 + 1.0


def _h_m(x: Tensor, m: Tensor | float) -> Tensor:
    """``h_m(x) = [x / d^(1/4), m]``: ``(..., d)`` to ``(..., d + 1)``."""
    d = x.shape[-1]
    m_col = torch.as_tensor(m, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], 1)
    return torch.cat([x / d**0.25, m_col], dim=-1)


def taylor_exact_feature_map(x: Tensor, m: Tensor | float) -> Tensor:
    """Exact second-order map ``phi(x) = [vec(h_m(x) (x) h_m(x)), 1]`` (``docs/method.md#tte``).

    ``<phi(q), phi(k)> = kappa_alpha(<q, k> / sqrt(d))`` exactly, with ``alpha = 1 - m^2``.

    Args:
        x: ``(..., d)``.
        m: ``sqrt(1 - alpha)``, scalar.

    Returns:
        ``(..., (d + 1)^2 + 1)``.
    """
    h = _h_m(x, m)
    outer = (h.unsqueeze(-1) * h.unsqueeze(-2)).flatten(-2)
    return torch.cat([outer, torch.ones_like(outer[..., :1])], dim=-1)


def psi_diag(x: Tensor, m: Tensor | float) -> Tensor:
    """The diagonal LATTE map ``psi_m(x)_i = (x_i / d^(1/4) + m)^2``: ``(..., d)`` to ``(..., d)``."""
    return (x / x.shape[-1] ** 0.25 + m) ** 2


def qtvit_feature_map(x: Tensor, eps: float = _EPS) -> Tensor:
    """QT-ViT's map without its constant column: L2-normalise, square, L2-normalise again.

    Follows ``LiteMLA.relu_linear_att`` of the public QT-ViT code; the constant column is
    appended by :func:`augment` with a calibrated scalar (``docs/method.md#variants``).
    """
    x = x / (x.norm(dim=-1, keepdim=True) + eps)
    x = x * x
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def jpn_normalize(feat: Tensor, delta: Tensor | float, eps: float = _EPS) -> Tensor:
    """Factorised JPN (``docs/method.md#jpn``): ``delta * feat / (||feat||_2 + eps)`` per token."""
    return delta * feat / (feat.norm(dim=-1, keepdim=True) + eps)


def augment(feat: Tensor, beta: Tensor | float) -> Tensor:
    """Appends the augmentation column ``beta`` (``docs/method.md#linear-form``): ``(..., F)`` to ``(..., F + 1)``."""
    col = torch.as_tensor(beta, dtype=feat.dtype, device=feat.device).expand(*feat.shape[:-1], 1)
    return torch.cat([feat, col], dim=-1)


def variant_features(
    q: Tensor,
    k: Tensor,
    variant: str,
    m: Tensor | float,
    delta_q: Tensor | float,
    delta_k: Tensor | float,
    beta_q: Tensor | float,
    beta_k: Tensor | float,
) -> tuple[Tensor, Tensor]:
    """Feature maps ``Q^``, ``K^`` of one variant (``docs/method.md#variants``), beta column included.

    ``jpn_only`` ignores ``m`` (alpha fixed at 0, so m = 1). ``tte_only`` and ``qtvit`` use
    QT-ViT's decoupled normalisation: each side is L2-normalised before the map and
    after it, then scaled by its delta. (The spec names the normalisation only by
    reference; pre-normalising is what separates it from JPN, whose factorised form is
    also per token.)

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``.

    Returns:
        ``(B, H, N, F + 1)`` and ``(B, H, M, F + 1)``.
    """
    if variant == "latte":
        fq, fk = psi_diag(q, m), psi_diag(k, m)
        fq, fk = jpn_normalize(fq, delta_q, _EPS), jpn_normalize(fk, delta_k, _EPS)
    elif variant == "jpn_only":
        fq, fk = psi_diag(q, 1.0), psi_diag(k, 1.0)
        fq, fk = jpn_normalize(fq, delta_q, _EPS), jpn_normalize(fk, delta_k, _EPS)
    elif variant == "tte_only":
        d = q.shape[-1]
        # Pre-normalise to the sqrt(d)-sphere's d^(1/4) scale so that psi_m's anchor keeps its units.
        qn = q / (q.norm(dim=-1, keepdim=True) + _EPS) * d**0.5
        kn = k / (k.norm(dim=-1, keepdim=True) + _EPS) * d**0.5
        fq, fk = psi_diag(qn, m), psi_diag(kn, m)
        fq, fk = jpn_normalize(fq, delta_q, _EPS), jpn_normalize(fk, delta_k, _EPS)
    elif variant == "qtvit":
        fq = jpn_normalize(qtvit_feature_map(q, _EPS), delta_q, _EPS)
        fk = jpn_normalize(qtvit_feature_map(k, _EPS), delta_k, _EPS)
    else:
        raise ValueError(f"unknown LATTE variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return augment(fq, beta_q), augment(fk, beta_k)


# ----------------------------------------------------------------------------- linear attention


def linear_attention(
    fq: Tensor, fk: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None
) -> Tensor:
    """Linear-time kernel attention ``O = Q^ (K^T V) / (Q^ (K^T 1))`` (``docs/method.md#linear-form``).

    ``K^T V`` and ``K^T 1`` accumulate in float32 whatever the input dtype; padded keys
    get zero features, so they add nothing to either sum. The output has ``v``'s dtype.

    Args/Returns: as :func:`naive_linear_attention`.
    """
    out_dtype = v.dtype
    acc = torch.promote_types(torch.promote_types(fq.dtype, v.dtype), torch.float32)  # >= float32
    fk32 = fk.to(acc)
    if key_padding_mask is not None:
        fk32 = fk32.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    fq32 = fq.to(acc)
    kv = fk32.transpose(-1, -2) @ v.to(acc)  # (B, H, F, d_v)
    ksum = fk32.sum(dim=-2)  # (B, H, F)
    num = fq32 @ kv
    denom = (fq32 @ ksum.unsqueeze(-1))  # (B, H, N, 1)
    out = num / torch.where(denom != 0, denom, torch.ones_like(denom))
    return out.to(out_dtype)


def uniform_attention(v: Tensor, key_padding_mask: Optional[Tensor] = None, num_queries: int = 1) -> Tensor:
    """The control: every query gets the mean of the valid values, ``(B, H, N, d_v)``.

    Args:
        v: ``(B, H, M, d_v)``. key_padding_mask: ``(B, M)``. num_queries: N.
    """
    if key_padding_mask is None:
        mean = v.mean(dim=-2, keepdim=True)
    else:
        keep = (~key_padding_mask)[:, None, :, None].to(v.dtype)
        mean = (v * keep).sum(dim=-2, keepdim=True) / keep.sum(dim=-2, keepdim=True).clamp_min(1)
    return mean.expand(*v.shape[:-2], num_queries, v.shape[-1])


def fused_latte_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    m: Tensor | float,
    rho: Tensor | float,
    key_padding_mask: Optional[Tensor] = None,
    eps: float = _EPS,
) -> Tensor:
    """The inference fast path of ``latte`` / ``jpn_only``: psi_m, JPN and the beta column, fused.

    Equal to ``linear_attention(*variant_features(q, k, 'latte', m, dq, dk, bq, bk), v)`` with
    ``rho = dq dk / (bq bk)``, but the constant column is handled analytically
    (``Q^ K^T = rho q~ k~^T + 1``) instead of concatenated, the feature maps are built in
    place, and the sums accumulate in float32 or wider.

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``.
        m: ``sqrt(1 - alpha)``; rho: ``delta_q delta_k / (beta_q beta_k)`` (> 0).
        key_padding_mask: ``(B, M)``, ``True`` = padded.

    Returns:
        ``(B, H, N, d_v)`` in ``v``'s dtype.
    """
    out_dtype = v.dtype
    acc = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    s = q.shape[-1] ** -0.25
    fq = (q.to(acc) * s).add_(m).square_()
    fq.mul_(torch.as_tensor(rho, dtype=acc, device=q.device) / (torch.linalg.vector_norm(fq, dim=-1, keepdim=True) + eps))
    fk = (k.to(acc) * s).add_(m).square_()
    fk.div_(torch.linalg.vector_norm(fk, dim=-1, keepdim=True) + eps)
    va = v.to(acc)
    if key_padding_mask is not None:
        keep = (~key_padding_mask)[:, None, :, None]
        fk.mul_(keep)
        va = va * keep
        count = keep.sum(dim=-2, keepdim=True).to(acc)  # (B, 1, 1, 1)
    else:
        # M as a tensor computed from k (not a Python number), so an ONNX trace keeps it dynamic
        count = torch.ones_like(k[:1, :1, :, :1], dtype=acc).sum(dim=-2, keepdim=True)  # (1, 1, 1, 1)
    kv = fk.transpose(-1, -2) @ va  # (B, H, d, d_v)
    ksum = fk.sum(dim=-2, keepdim=True).transpose(-1, -2)  # (B, H, d, 1)
    vsum = va.sum(dim=-2, keepdim=True)  # (B, H, 1, d_v)
    num = torch.baddbmm(vsum.flatten(0, 1), fq.flatten(0, 1), kv.flatten(0, 1)).view(*fq.shape[:-1], -1)
    den = (fq @ ksum).add_(count)
    out = num.div_(torch.where(den != 0, den, torch.ones_like(den)))
    return out.to(out_dtype)


_COMPILED = None


def compiled_fused_latte_attention():
    """:func:`fused_latte_attention` through ``torch.compile`` (dynamic shapes), built once.

    Same contract and results (tested against the eager function); on CPU inductor fuses the
    element-wise feature maps into the loops around the two matmuls (about 2x faster from
    4k tokens, docs/deployment.md). The first call compiles (~30 s on 2 cores); needs a C++ compiler.
    """
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(fused_latte_attention, dynamic=True)
    return _COMPILED


#: Kernels of the fused linear path: ``auto`` (Triton on supported CUDA tensors, else eager),
#: ``eager`` (never Triton), ``compiled`` (``torch.compile`` on CPU; Triton on CUDA), ``triton``
#: (the Triton kernel wherever it takes the tensors, CPU ones under ``TRITON_INTERPRET=1``).
BACKENDS = ("auto", "eager", "compiled", "triton")


def resolve_backend(setting: Optional[str] = None) -> str:
    """The backend a layer keeps: ``setting``, else the ``LATTE_KERNEL`` environment variable,
    else ``auto``. Called once, when a layer is built or loaded; never per forward.

    Raises:
        ValueError: an unknown backend (names the setting and the choices).
    """
    name = setting or os.environ.get("LATTE_KERNEL") or "auto"
    if name not in BACKENDS:
        source = "backend" if setting else "LATTE_KERNEL"
        raise ValueError(f"{source}={name!r} is not a LATTE kernel backend; choose one of {', '.join(BACKENDS)}")
    return name


def _triton_takes(q: Tensor, k: Tensor, v: Tensor, backend: str) -> bool:
    if backend == "eager" or (backend != "triton" and not q.is_cuda):
        return False
    try:
        from . import triton_latte
    except ImportError:  # pragma: no cover
        return False
    return triton_latte.available() and triton_latte.supported(q, k, v)


def latte_attention(q: Tensor, k: Tensor, v: Tensor, m: Tensor | float, rho: Tensor | float,
                    key_padding_mask: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """Fused LATTE attention by ``backend`` (:data:`BACKENDS`): the contract of
    :func:`fused_latte_attention`, whichever kernel runs (all tested against it)."""
    if _triton_takes(q, k, v, backend):
        from . import triton_latte

        return triton_latte.triton_latte_attention(q, k, v, m, rho, key_padding_mask)
    if backend == "compiled" and not torch.jit.is_tracing():
        return compiled_fused_latte_attention()(q, k, v, m, rho, key_padding_mask)
    return fused_latte_attention(q, k, v, m, rho, key_padding_mask)
