"""Attention-core FLOP counts (projections excluded; they are the same in both modes).

One multiply-add counts as 2 FLOPs. Per head, with N queries, M keys, head width d
(values d_v) and LATTE feature width F = d + 1 (diagonal map plus the beta column):

* exact:  ``QK^T`` 2NMd, softmax 3NM (exp, sum, divide), ``PV`` 2NMd_v;
* linear: feature maps ~6(N+M)d (square, norm, scale), ``K^T V`` 2MFd_v, ``K^T 1`` MF,
  ``Q(K^T V)`` 2NFd_v, ``Q(K^T 1)`` 2NF, divide Nd_v.
* piecewise (``t`` exact blocks of ``b`` tokens, ``K = ceil(M / b)`` key blocks): pooling (N+M)d,
  block scores 2(N/b)Kd, the exact part as exact attention over tb keys per query, the rest
  scores 2NKd + 3NK, its sums 2NK(d_v + 1), the first-order term 2Md d_v + 2Nd d_v.
"""
from __future__ import annotations

__all__ = ["attention_gflops", "exact_attention_flops", "linear_attention_flops", "piecewise_attention_flops",
           "uniform_attention_flops", "layer_flops", "mode_flops"]


def exact_attention_flops(n: int, m: int, d: int, d_v: int, heads: int) -> int:
    return heads * (2 * n * m * d + 3 * n * m + 2 * n * m * d_v)


def linear_attention_flops(n: int, m: int, d: int, d_v: int, heads: int) -> int:
    f = d + 1
    return heads * (6 * (n + m) * d + 2 * m * f * d_v + m * f + 2 * n * f * d_v + 2 * n * f + n * d_v)


def piecewise_attention_flops(n: int, m: int, d: int, d_v: int, heads: int, top: int, block: int) -> int:
    kb = -(-m // block)
    keys = min(top, kb) * block
    exact = 2 * n * keys * d + 3 * n * keys + 2 * n * keys * d_v
    rest = 2 * n * kb * d + 3 * n * kb + 2 * n * kb * (d_v + 1) + 2 * m * d * d_v + 2 * n * d * d_v
    return heads * ((n + m) * d + 2 * (-(-n // block)) * kb * d + exact + rest)


def uniform_attention_flops(n: int, m: int, d_v: int, heads: int) -> int:
    """The control: one mean over the M values, broadcast to N queries."""
    return heads * (m * d_v + n * d_v)


def layer_flops(n: int, m: int, embed_dim: int, heads: int, linear: bool) -> int:
    """FLOPs of one attention layer's core in the given mode."""
    d = embed_dim // heads
    fn = linear_attention_flops if linear else exact_attention_flops
    return fn(n, m, d, d, heads)


def mode_flops(n: int, m: int, embed_dim: int, heads: int, mode: str, piecewise: tuple = ()) -> int:
    """FLOPs of one attention layer's core in ``mode`` (``exact``, ``linear``/``dynamic``, ``uniform``);
    ``piecewise``: ``(top, block)`` when its non-exact kernel is the piecewise one."""
    if mode == "uniform":
        return uniform_attention_flops(n, m, embed_dim // heads, heads)
    if mode != "exact" and piecewise:
        d = embed_dim // heads
        return piecewise_attention_flops(n, m, d, d, heads, *piecewise)
    return layer_flops(n, m, embed_dim, heads, mode != "exact")


def attention_gflops(shapes: dict, layers: dict, linear, mode: str = "linear") -> float:
    """Attention-core GFLOPs of one image, given each layer's ``(N, M)`` in ``shapes`` and its
    ``LatteParams`` in ``layers``: ``linear`` layers in ``mode``, the rest exact."""
    linear = set(linear)
    total = 0
    for name, (n, m) in shapes.items():
        lay = layers[name]
        pw = (int(lay.piecewise_top), int(lay.piecewise_block)) if getattr(lay, "kernel", "latte") == "piecewise" else ()
        total += mode_flops(n, m, lay.embed_dim, lay.num_heads, mode if name in linear else "exact", pw)
    return total / 1e9
