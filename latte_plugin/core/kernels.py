"""LATTE attention math as small pure functions (the method: ``docs/method.md``).

Every tensor is laid out per head: ``q`` is ``(B, H, N, d)``, ``k`` is ``(B, H, M, d)``,
``v`` is ``(B, H, M, d_v)``. ``key_padding_mask`` is ``(B, M)`` with ``True`` marking a
padded key (the torch / mmcv convention). Each fast path has a ``naive_`` reference
beside it that materialises the full ``N x M`` score matrix; tests compare the two.

Nothing here imports a detection framework.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "VARIANTS",
    "naive_softmax_attention",
    "softmax_attention",
    "taylor_exact_feature_map",
    "taylor_kernel",
    "psi_diag",
    "qtvit_feature_map",
    "jpn_normalize",
    "augment",
    "variant_features",
    "naive_linear_attention",
    "linear_attention",
    "bool_attn_mask",
    "uniform_attention",
    "fused_latte_attention",
    "compiled_fused_latte_attention",
]

#: The four variants (``docs/method.md#variants``), by name.
VARIANTS = ("qtvit", "jpn_only", "tte_only", "latte")

_EPS = 1e-6


def _additive_mask(
    key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], dtype: torch.dtype
) -> Optional[Tensor]:
    """Combines the masks into one additive float mask broadcastable to ``(B, H, N, M)``."""
    bias = None
    if key_padding_mask is not None:
        bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
        bias = bias.masked_fill(key_padding_mask, float("-inf"))[:, None, None, :]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            am = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
                attn_mask, float("-inf")
            )
        else:
            am = attn_mask.to(dtype)
        if am.dim() == 2:  # (N, M)
            am = am[None, None]
        elif am.dim() != 4:
            raise ValueError(
                f"attn_mask must be (N, M) or (B, H, N, M), got shape {tuple(attn_mask.shape)}; "
                "reshape a (B*H, N, M) mask to (B, H, N, M) first"
            )
        bias = am if bias is None else bias + am
    return bias


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
    bias = _additive_mask(key_padding_mask, attn_mask, scores.dtype)
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


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                      attn_mask: Optional[Tensor] = None) -> Tensor:
    """Fast softmax attention through ``scaled_dot_product_attention``; same contract as the naive one.

    Fully masked rows return zeros, as in :func:`naive_softmax_attention`.
    """
    bias = _additive_mask(key_padding_mask, attn_mask, q.dtype)
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


def naive_jpn_similarity(
    fq: Tensor, fk: Tensor, delta_q: float, delta_k: float, eps: float = _EPS
) -> Tensor:
    """JPN in the paper's joint form ``delta_q delta_k <q2, k2> / h'(q, k)^2``: ``(..., N, M)``.

    Reference for :func:`jpn_normalize`; ``fq`` is ``(..., N, F)``, ``fk`` is ``(..., M, F)``.
    """
    h2 = (fq.norm(dim=-1, keepdim=True) + eps) * (fk.norm(dim=-1, keepdim=True) + eps).transpose(-1, -2)
    return delta_q * delta_k * (fq @ fk.transpose(-1, -2)) / h2


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
    eps: float = _EPS,
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
        fq, fk = jpn_normalize(fq, delta_q, eps), jpn_normalize(fk, delta_k, eps)
    elif variant == "jpn_only":
        fq, fk = psi_diag(q, 1.0), psi_diag(k, 1.0)
        fq, fk = jpn_normalize(fq, delta_q, eps), jpn_normalize(fk, delta_k, eps)
    elif variant == "tte_only":
        d = q.shape[-1]
        # Pre-normalise to the sqrt(d)-sphere's d^(1/4) scale so that psi_m's anchor keeps its units.
        qn = q / (q.norm(dim=-1, keepdim=True) + eps) * d**0.5
        kn = k / (k.norm(dim=-1, keepdim=True) + eps) * d**0.5
        fq, fk = psi_diag(qn, m), psi_diag(kn, m)
        fq, fk = jpn_normalize(fq, delta_q, eps), jpn_normalize(fk, delta_k, eps)
    elif variant == "qtvit":
        fq = jpn_normalize(qtvit_feature_map(q, eps), delta_q, eps)
        fk = jpn_normalize(qtvit_feature_map(k, eps), delta_k, eps)
    else:
        raise ValueError(f"unknown LATTE variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return augment(fq, beta_q), augment(fk, beta_k)


# ----------------------------------------------------------------------------- linear attention


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


def bool_attn_mask(attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """An attention mask as bool (``True`` = masked), or ``None`` if it masks nothing.

    Accepts bool masks and additive float masks made of 0 and very negative values
    (``-inf`` or the dtype's minimum). A ``(N, M)`` mask becomes ``(1, 1, N, M)``.

    Raises:
        ValueError: for a float mask holding other values (additive biases such as ALiBi),
            which no kernel feature map can reproduce.
    """
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        masked = attn_mask
    else:
        masked = attn_mask <= torch.finfo(attn_mask.dtype).min / 2
        if not bool(((attn_mask == 0) | masked).all()):
            raise ValueError(
                f"LATTE linear attention cannot honour an additive attention bias (attn_mask of shape "
                f"{tuple(attn_mask.shape)} holds values other than 0 / -inf); keep this layer exact"
            )
    if not bool(masked.any()):
        return None
    return masked[None, None] if masked.dim() == 2 else masked


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
