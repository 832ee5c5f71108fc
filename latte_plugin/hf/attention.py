"""LATTE inside HF ``transformers`` attention modules, through their own dispatch.

Since transformers 4.48 every maintained attention module (``ViTAttention``,
``CLIPAttention``, ``BertSelfAttention``, ``RTDetrSelfAttention``, ...) projects q, k, v
itself and then calls ``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation)``.
We register one more implementation, ``"latte"``, and point *only the candidate modules*
at it by giving each a shallow copy of its config. The rest of the model, and the mask
the model builds, keep the original implementation.

``latte_attention_forward`` dispatches to the module's :class:`LatteParams`; in exact mode
with nothing attached it calls the module's original implementation, so the output is
bit-identical to the untouched model.
"""
from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..nn.params import LatteParams

__all__ = ["LATTE_IMPLEMENTATION", "is_hf_attention", "install_latte", "latte_attention_forward", "split_hf_mask"]

LATTE_IMPLEMENTATION = "latte"
_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(LATTE_IMPLEMENTATION, latte_attention_forward)
        _REGISTERED = True


def _head_dim(module: nn.Module) -> Optional[int]:
    for attr in ("head_dim", "attention_head_size"):
        if isinstance(getattr(module, attr, None), int):
            return int(getattr(module, attr))
    return None


def _value_proj(module: nn.Module) -> Optional[nn.Linear]:
    for attr in ("v_proj", "value"):
        lin = getattr(module, attr, None)
        if isinstance(lin, nn.Linear):
            return lin
    return None


def is_hf_attention(module: nn.Module) -> bool:
    """True for an HF attention module that dispatches through ``ALL_ATTENTION_FUNCTIONS``."""
    cfg = getattr(module, "config", None)
    return (
        cfg is not None
        and hasattr(cfg, "_attn_implementation")
        and _head_dim(module) is not None
        and _value_proj(module) is not None
    )


def _fallback(module: nn.Module, implementation: Optional[str]) -> Callable:
    """The implementation the module used before: a registered one, or its file's eager function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation not in (None, "eager", LATTE_IMPLEMENTATION) and implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__} has no module-level eager_attention_forward; load the model with "
            "attn_implementation='sdpa' before installing LATTE"
        )
    return eager


def install_latte(module: nn.Module, variant: str = "latte") -> LatteParams:
    """Gives an HF attention module a LATTE core (idempotent); returns its :class:`LatteParams`.

    The module gains the child ``latte`` (its buffers join the state dict) and a private
    config copy whose ``_attn_implementation`` is ``"latte"``. Parameters are untouched.
    """
    if not is_hf_attention(module):
        raise ValueError(f"{type(module).__name__} is not an HF attention module that dispatches through "
                         "ALL_ATTENTION_FUNCTIONS (needs .config, .head_dim and a v_proj/value Linear)")
    _register()
    if isinstance(getattr(module, "latte", None), LatteParams):
        return module.latte
    head_dim = _head_dim(module)
    v_out = _value_proj(module).out_features
    if v_out % head_dim != 0:
        raise ValueError(f"{type(module).__name__}: value width {v_out} is not divisible by head_dim {head_dim}")
    previous = module.config._attn_implementation
    module._latte_fallback = _fallback(module, previous)
    cfg = copy.copy(module.config)
    cfg._attn_implementation_internal = LATTE_IMPLEMENTATION  # this module only; no sub-config recursion
    module.config = cfg
    p = next(iter(module.parameters()), None)
    module.latte = LatteParams(v_out, v_out // head_dim, variant=variant)
    if p is not None:
        module.latte.to(p.device)
    return module.latte


def split_hf_mask(
    attention_mask: Optional[Tensor], num_queries: int, num_keys: int
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """HF's 4-d mask -> ``(key_padding_mask (B, M) True = padded, attn_mask)`` in our convention.

    HF gives ``(B, 1, N, M)`` either bool (``True`` = attend, sdpa) or additive float
    (0 / very negative, eager). A mask that is the same for every query row is a key
    padding mask (linear attention handles it exactly and fast); anything else (causal) is
    returned as a bool ``attn_mask`` with ``True`` = masked. A float mask holding biases
    other than 0 / -inf is returned unchanged (softmax honours it; linear mode rejects it).
    """
    if attention_mask is None:
        return None, None
    am = attention_mask
    if am.dtype == torch.bool:
        masked = ~am
    else:
        very_neg = am <= torch.finfo(am.dtype).min / 2
        if not bool(((am == 0) | very_neg).all()):
            return None, am
        masked = very_neg
    if masked.dim() == 2:
        masked = masked[:, None, None, :]
    masked = masked.expand(masked.shape[0], masked.shape[1], num_queries, num_keys)
    if bool((masked == masked[:, :1, :1, :]).all()):
        kpm = masked[:, 0, 0, :]
        return (kpm if bool(kpm.any()) else None), None
    return None, masked


def latte_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``"latte"`` entry of ``ALL_ATTENTION_FUNCTIONS``.

    Args:
        query: ``(B, H, N, d)``; key: ``(B, H_kv, M, d)``; value: ``(B, H_kv, M, d_v)``.
        attention_mask: HF's mask (see :func:`split_hf_mask`).
        scaling: the softmax scale (``d ** -0.5`` unless the model says otherwise).

    Returns:
        ``((B, N, H, d_v), None)`` as HF's implementations do.
    """
    latte: LatteParams = module.latte
    if latte.mode == "exact" and not latte.tapped:
        return module._latte_fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    d = query.shape[-1]
    if scaling is not None and abs(float(scaling) * d**0.5 - 1.0) > 1e-6:
        query = query * (float(scaling) * d**0.5)  # our kernels use 1/sqrt(d)
    n, m = query.shape[-2], key.shape[-2]
    kpm, attn_mask = split_hf_mask(attention_mask, n, m)
    causal = kwargs.get("is_causal", getattr(module, "is_causal", False))
    if attention_mask is None and causal and n > 1:
        attn_mask = torch.ones(n, m, dtype=torch.bool, device=query.device).triu(m - n + 1)[None, None]
    try:
        out = latte(query, key, value, kpm, attn_mask)  # (B, H, N, d_v)
    except ValueError as err:  # e.g. an additive bias: name the layer, say what to do
        raise ValueError(f"{getattr(latte, 'layer_name', type(module).__name__)}: {err}") from None
    return out.transpose(1, 2).contiguous(), None
