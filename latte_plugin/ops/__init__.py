"""Attention kernels, torch only: the fast paths (:mod:`.latte`, :mod:`.triton_latte`) and their
plain references (:mod:`.naive`), masks and FLOP counts. Nothing here knows a layer or a framework."""
from .latte import (BACKENDS, VARIANTS, augment, compiled_fused_latte_attention, fused_latte_attention, jpn_normalize,
                    latte_attention, linear_attention, psi_diag, qtvit_feature_map, resolve_backend, softmax_attention,
                    taylor_exact_feature_map, taylor_kernel, uniform_attention, variant_features)
from .masks import additive_mask, bool_attn_mask
from .naive import (naive_jpn_similarity, naive_linear_attention, naive_lowrank_similarity_order, naive_piecewise_attention,
                    naive_similarity_order, naive_softmax_attention)
from .piecewise import ORDERS, PIECEWISE_BLOCK, RESTS, PiecewiseSpec, piecewise_attention

__all__ = ["BACKENDS", "VARIANTS", "augment", "compiled_fused_latte_attention", "fused_latte_attention",
           "jpn_normalize", "latte_attention", "linear_attention", "psi_diag", "qtvit_feature_map", "resolve_backend",
           "softmax_attention", "taylor_exact_feature_map", "taylor_kernel", "uniform_attention", "variant_features",
           "additive_mask", "bool_attn_mask", "naive_jpn_similarity", "naive_linear_attention",
           "naive_softmax_attention", "naive_piecewise_attention", "naive_similarity_order", "naive_lowrank_similarity_order", "piecewise_attention", "PIECEWISE_BLOCK", "RESTS", "ORDERS", "PiecewiseSpec"]
