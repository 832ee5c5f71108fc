"""``torch.nn.MultiheadAttention`` with a LATTE core, and the swap that installs it.

The glue only projects, reshapes and dispatches; the math lives in :mod:`.kernels`.
:class:`LatteMultiheadAttention` *is* an ``nn.MultiheadAttention`` (same parameter names),
so pretrained state dicts load unchanged; it only adds the ``latte.*`` buffers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .install import match_candidates
from .params import LatteParams, merge_heads

__all__ = ["project_mha", "latte_mha_forward", "LatteMultiheadAttention", "swap_mha"]


def project_mha(
    attn: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v projections of a ``torch.nn.MultiheadAttention``, split into heads.

    Args:
        attn: the module whose weights are used (shared, not copied).
        query: ``(B, N, C)``; key, value: ``(B, M, C_k)`` (batch first).

    Returns:
        q ``(B, H, N, d)``, k ``(B, H, M, d)``, v ``(B, H, M, d_v)``.
    """
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError("LATTE does not support nn.MultiheadAttention with add_bias_kv or add_zero_attn")
    c, h = attn.embed_dim, attn.num_heads
    b_in = attn.in_proj_bias
    bq = bk = bv = None
    if b_in is not None:
        bq, bk, bv = b_in[:c], b_in[c : 2 * c], b_in[2 * c :]
    if attn._qkv_same_embed_dim:
        wq, wk, wv = attn.in_proj_weight[:c], attn.in_proj_weight[c : 2 * c], attn.in_proj_weight[2 * c :]
    else:
        wq, wk, wv = attn.q_proj_weight, attn.k_proj_weight, attn.v_proj_weight
    f = torch.nn.functional.linear
    q, k, v = f(query, wq, bq), f(key, wk, bk), f(value, wv, bv)

    def split(x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, h, -1).transpose(1, 2)

    return split(q), split(k), split(v)


def latte_mha_forward(attn: nn.MultiheadAttention, latte: LatteParams, query: Tensor, key: Tensor, value: Tensor,
                      key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None) -> Tensor:
    """What ``attn(query, key, value)[0]`` computes, with the attention core dispatched by ``latte``.

    Args:
        query: ``(B, N, C)``; key, value: ``(B, M, C)`` (batch first).
        key_padding_mask: ``(B, M)``, bool or 0/1. attn_mask: ``(N, M)``, ``(B*H, N, M)`` or ``(B, H, N, M)``.

    Returns:
        ``(B, N, C)`` after the output projection. Attention dropout is not applied
        (calibrated models run in eval mode).
    """
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask.bool()
    q, k, v = project_mha(attn, query, key, value)
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.view(q.shape[0], q.shape[1], *attn_mask.shape[-2:])
    o = merge_heads(latte(q, k, v, key_padding_mask, attn_mask))
    return attn.out_proj(o)


class LatteMultiheadAttention(nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` whose attention core can be exact, LATTE-linear or dynamic.

    In exact mode, with no calibration recorder or probe attached, ``forward`` is
    ``nn.MultiheadAttention.forward`` itself, so the output is bit-identical.
    The LATTE state is the child ``latte`` (:class:`LatteParams`).
    """

    def __init__(self, *args, variant: str = "latte", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.latte = LatteParams(self.embed_dim, self.num_heads, variant=variant)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, variant: str = "latte") -> "LatteMultiheadAttention":
        """Wraps an existing module, sharing (not copying) its parameters."""
        if isinstance(mha, cls):
            return mha
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.__dict__.update({k: v for k, v in mha.__dict__.items() if k not in ("_parameters", "_modules", "_buffers")})
        new._parameters = dict(mha._parameters)
        new._buffers = dict(mha._buffers)
        new._modules = dict(mha._modules)
        p = next(iter(mha.parameters()), None)
        new.latte = LatteParams(mha.embed_dim, mha.num_heads, variant=variant)
        if p is not None:
            new.latte.to(p.device)
        return new

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        latte = self.latte
        # torch's own forward, except in an ONNX export: its inference fast path
        # (aten::_native_multi_head_attention) has no ONNX form, our exact path (SDPA) has
        if (latte.mode == "exact" and not latte.tapped
                and not torch.onnx.is_in_onnx_export()):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        if is_causal:
            raise ValueError("LATTE linear attention cannot honour is_causal=True; keep this layer exact")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        out = latte_mha_forward(self, latte, query, key, value, key_padding_mask, attn_mask)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
        return out, None


def swap_mha(model: nn.Module, patterns: Sequence[str], variant: str = "latte") -> list[str]:
    """Replaces every ``nn.MultiheadAttention`` named by ``patterns`` with :class:`LatteMultiheadAttention`.

    A pattern may name the ``nn.MultiheadAttention`` itself or a wrapper that holds one as
    ``.attn`` (mmcv's ``MultiheadAttention``). Idempotent. The LATTE layer is reported
    under the matched (wrapper) name.

    Returns:
        The matched module names, in model order.

    Raises:
        ValueError: a pattern matching no module, or a matched module with no MHA inside.
    """

    modules = dict(model.named_modules())
    names = match_candidates([n for n in modules if n], patterns)
    for name in names:
        mod = modules[name]
        if isinstance(mod, nn.MultiheadAttention):
            parent_name, _, child = name.rpartition(".")
            parent = modules[parent_name] if parent_name else model
            new = LatteMultiheadAttention.from_torch(mod, variant)
            setattr(parent, child, new)
        elif isinstance(getattr(mod, "attn", None), nn.MultiheadAttention):
            new = LatteMultiheadAttention.from_torch(mod.attn, variant)
            mod.attn = new
        else:
            raise ValueError(
                f"module {name!r} ({type(mod).__name__}) matched a candidate pattern but is not an "
                "nn.MultiheadAttention and holds none as .attn; narrow the pattern"
            )
        new.latte.layer_name = name
    return names
