"""Attention masks in the two forms the kernels take: bool (``True`` = masked) and additive."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["additive_mask", "bool_attn_mask"]


def additive_mask(
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
