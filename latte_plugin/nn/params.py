"""One layer's LATTE state and its inference: exact, linear, dynamic or uniform attention.

:class:`LatteParams` holds the calibrated scalars of one attention layer as buffers, so
they travel in an ordinary ``state_dict`` (and load with ``weights_only=True``). A framework
adapter projects q, k, v itself and calls the module; nothing here knows about mmdet,
detectron2 or calibration.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops

__all__ = ["MODES", "KERNELS", "LatteParams", "own_values", "merge_heads"]

#: ``exact`` = softmax; ``linear`` = LATTE; ``dynamic`` = softmax below ``threshold`` keys;
#: ``uniform`` = the mean of the values (a control that shows how much attention matters).
MODES = ("exact", "linear", "dynamic", "uniform")
#: The kernel of a non-exact (``linear``/``dynamic``) layer: ``latte`` (the calibrated Taylor kernel)
#: or ``piecewise`` (exact softmax on the top key blocks, the rest approximated: ``ops.piecewise``).
KERNELS = ("latte", "piecewise")
#: Buffers added after the first checkpoints were written, with the value an older checkpoint means.
_LATER_BUFFERS = {"kernel_id": 0, "piecewise_top": 0, "piecewise_gamma": 1.0, "piecewise_rest_id": 0,
                  "piecewise_block": ops.PIECEWISE_BLOCK, "piecewise_order_id": 0, "diag_on": False, "diag_weight": 0.0}


def _fastpath_guard(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook. Its presence stops ``nn.TransformerEncoderLayer``'s fused
    inference fast path, which would call torch's native attention kernel and bypass the
    LATTE core of a swapped ``self_attn`` (the layer checks for hooks on all submodules)."""
    return None


class LatteParams(nn.Module):
    """The LATTE scalars of one attention layer (``docs/method.md#tte`` to ``#dynamic``).

    Gauge (``docs/method.md#linear-form``): the output depends on ``delta_q delta_k / (beta_q beta_k)`` only,
    so we fit ``log_rho = log(delta_q delta_k)`` with ``beta_q = beta_k = 1`` and report
    ``delta_q = delta_k = sqrt(rho)``. ``alpha = 1 - m^2`` is always <= 1.

    Buffers (all in the state dict): ``m`` and ``log_rho`` ``(num_heads,)`` (equal across
    heads unless calibrated with ``per_head=True``), ``sigma`` ``(embed_dim,)``,
    ``variant_id``, ``mode_id``, ``threshold`` and ``calibrated``.

    Args:
        embed_dim: concatenated head width ``C = H * d_v``.
        num_heads: number of heads ``H``.
        variant: one of :data:`ops.VARIANTS`.
        mode: one of :data:`MODES`.
        threshold: for ``dynamic`` mode, the key count below which softmax is used.
        backend: the kernel of the fused linear path (:data:`~latte_plugin.ops.latte.BACKENDS`); default: the
            ``LATTE_KERNEL`` environment variable, else ``auto``. Resolved here, once (:func:`set_backend`
            changes it on a built model); a forward never reads the environment.

    Calibration taps (recorders, probes) are forward hooks on this module, registered by
    :mod:`latte_plugin.calibration.taps` for one pass and removed after it: adapters call the
    module (``latte(q, k, v, ...)``), so the hooks see every call, and inference holds none.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, variant: str = "latte", mode: str = "exact", threshold: int = 0,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        # One (m, log_rho) per head; they are all equal unless fitted per head.
        self.register_buffer("m", torch.ones(num_heads))
        self.register_buffer("log_rho", torch.zeros(num_heads))
        self.register_buffer("sigma", torch.ones(embed_dim))
        # Output refit (beyond the paper): o <- o W^T + b on the concatenated heads, i.e. the
        # output projection refitted as W_o W, b_o + W_o b. Identity / off unless calibrated so.
        self.register_buffer("refit_weight", torch.eye(embed_dim))
        self.register_buffer("refit_bias", torch.zeros(embed_dim))
        self.register_buffer("refit_on", torch.tensor(False))
        # Diagonal term (correction='diag', beyond the paper): o <- o + v_own U^T, each query's own
        # value (self-attention) mapped by U: the share of the attention row on its own token that
        # the bounded kernel cannot concentrate. Zero / off unless calibrated so.
        self.register_buffer("diag_weight", torch.zeros(embed_dim, embed_dim))
        self.register_buffer("diag_on", torch.tensor(False))
        self.register_buffer("variant_id", torch.tensor(0, dtype=torch.long))
        self.register_buffer("mode_id", torch.tensor(0, dtype=torch.long))
        self.register_buffer("threshold", torch.tensor(int(threshold), dtype=torch.long))
        self.register_buffer("calibrated", torch.tensor(False))
        # the piecewise kernel (ops.piecewise): exact key blocks per query block, mass scale, rest rule
        self.register_buffer("kernel_id", torch.tensor(0, dtype=torch.long))
        self.register_buffer("piecewise_top", torch.tensor(0, dtype=torch.long))
        self.register_buffer("piecewise_gamma", torch.tensor(1.0))
        self.register_buffer("piecewise_rest_id", torch.tensor(0, dtype=torch.long))
        self.register_buffer("piecewise_block", torch.tensor(ops.PIECEWISE_BLOCK, dtype=torch.long))
        self.register_buffer("piecewise_order_id", torch.tensor(0, dtype=torch.long))
        self.variant = variant
        self.mode = mode
        self.backend = ops.resolve_backend(backend)
        self.register_forward_pre_hook(_fastpath_guard)

    # -- names <-> buffers -------------------------------------------------------------
    @property
    def variant(self) -> str:
        return ops.VARIANTS[int(self.variant_id)]

    @variant.setter
    def variant(self, name: str) -> None:
        if name not in ops.VARIANTS:
            raise ValueError(f"unknown LATTE variant {name!r}; choose one of {', '.join(ops.VARIANTS)}")
        self.variant_id.fill_(ops.VARIANTS.index(name))

    @property
    def mode(self) -> str:
        return MODES[int(self.mode_id)]

    @mode.setter
    def mode(self, name: str) -> None:
        if name not in MODES:
            raise ValueError(f"unknown attention mode {name!r}; choose one of {', '.join(MODES)}")
        self.mode_id.fill_(MODES.index(name))

    @property
    def kernel(self) -> str:
        """The kernel of this layer's non-exact modes (:data:`KERNELS`)."""
        return KERNELS[int(self.kernel_id)]

    @kernel.setter
    def kernel(self, name: str) -> None:
        if name not in KERNELS:
            raise ValueError(f"unknown LATTE kernel {name!r}; choose one of {', '.join(KERNELS)}")
        self.kernel_id.fill_(KERNELS.index(name))

    @property
    def piecewise_rest(self) -> str:
        return ops.RESTS[int(self.piecewise_rest_id)]

    @property
    def piecewise_order(self) -> str:
        return ops.ORDERS[int(self.piecewise_order_id)]

    def set_piecewise(self, top: int, gamma: float = 1.0, rest: str = "blockmean", block: int = ops.PIECEWISE_BLOCK,
                      order: str = "tokens") -> None:
        """Makes this layer's kernel piecewise with ``top`` exact key blocks of about ``block`` tokens
        formed in ``order`` (:data:`~latte_plugin.ops.piecewise.ORDERS`)."""
        ops.PiecewiseSpec(int(top), float(gamma), rest, int(block), order)  # validates
        self.kernel = "piecewise"
        self.piecewise_top.fill_(int(top))
        self.piecewise_gamma.fill_(float(gamma))
        self.piecewise_rest_id.fill_(ops.RESTS.index(rest))
        self.piecewise_block.fill_(int(block))
        self.piecewise_order_id.fill_(ops.ORDERS.index(order))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # a checkpoint written before the piecewise kernel existed holds LATTE layers: fill its defaults
        if prefix + "mode_id" in state_dict:
            for key, value in _LATER_BUFFERS.items():
                if prefix + key not in state_dict:
                    state_dict[prefix + key] = torch.full_like(getattr(self, key), value)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def alpha(self) -> float:
        """The anchor, averaged over heads (they are equal unless fitted per head)."""
        return float((1.0 - self.m.double() ** 2).mean())

    def set_alpha(self, alpha: float) -> None:
        """Sets the Taylor anchor. Raises ``ValueError`` for ``alpha > 1`` (then ``m`` would be imaginary)."""
        if not math.isfinite(alpha) or alpha > 1.0:
            raise ValueError(f"alpha must be a finite number <= 1 (m = sqrt(1 - alpha)), got {alpha}")
        self.m.fill_(math.sqrt(1.0 - alpha))

    def scalars(self) -> dict[str, float]:
        """The five reported scalars ``{alpha, delta_q, delta_k, beta_q, beta_k}`` (head means),
        plus ``alpha_per_head`` / ``delta_per_head`` when the heads differ."""
        deltas = torch.exp(0.5 * self.log_rho.double())
        alphas = torch.zeros_like(deltas) if self.variant == "jpn_only" else 1.0 - self.m.double() ** 2
        delta = float(deltas.mean())
        out = {"alpha": float(alphas.mean()), "delta_q": delta, "delta_k": delta, "beta_q": 1.0, "beta_k": 1.0}
        if bool((alphas != alphas[0]).any() or (deltas != deltas[0]).any()):
            out["alpha_per_head"] = [float(a) for a in alphas]
            out["delta_per_head"] = [float(d) for d in deltas]
        return out

    # -- attention -----------------------------------------------------------------------
    def features(self, q: Tensor, k: Tensor, m: Optional[Tensor] = None, log_rho: Optional[Tensor] = None):
        """Feature maps of this layer's variant; ``m``/``log_rho`` override the buffers (for fitting)."""
        m = (self.m if m is None else m).view(-1, 1, 1)  # (H, 1, 1) broadcasts over (..., H, N, d)
        log_rho = (self.log_rho if log_rho is None else log_rho).view(-1, 1, 1)
        delta = torch.exp(0.5 * log_rho)
        return ops.variant_features(q, k, self.variant, m, delta, delta, 1.0, 1.0)

    def linear(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """LATTE linear attention with sigma applied: ``(B, H, N, d_v)``.

        ``latte`` and ``jpn_only`` run the fused fast path of the layer's ``backend``
        (:func:`~latte_plugin.ops.latte.latte_attention`: the Triton kernel on CUDA tensors, the eager fused
        function, or that function through ``torch.compile``); the others (and calibration, via
        :meth:`features`) use the reference composition it is tested against. A general
        ``attn_mask`` (bool, ``True`` = masked, e.g. causal) takes the quadratic masked path.
        """
        variant = self.variant
        v_own = own_values(q, v)
        if self.kernel == "piecewise":
            return self.correct(self.piecewise(q, k, v, key_padding_mask, attn_mask), v_own)
        if attn_mask is None and variant in ("latte", "jpn_only"):
            m = self.m.view(-1, 1, 1) if variant == "latte" else 1.0
            rho = torch.exp(self.log_rho).view(-1, 1, 1)
            o = ops.latte_attention(q, k, v, m, rho, key_padding_mask, self.backend)
        else:
            # feature maps in >= float32: squared features overflow float16 at large activations
            acc = torch.promote_types(q.dtype, torch.float32)
            fq, fk = self.features(q.to(acc), k.to(acc))
            if attn_mask is None:
                o = ops.linear_attention(fq, fk, v, key_padding_mask)
            else:
                o = ops.naive_linear_attention(fq, fk, v.to(acc), key_padding_mask, attn_mask).to(v.dtype)
        return self.correct(o, v_own)

    def piecewise(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                  attn_mask: Optional[Tensor] = None, q_pool: Optional[Tensor] = None) -> Tensor:
        """The piecewise kernel (before the output correction): ``(B, H, N, d_v)``.

        The fused path (:func:`~latte_plugin.ops.piecewise.piecewise_attention`; its exact part in
        Triton with ``backend='triton'`` or on CUDA) unless ``q_pool`` is given: calibration's
        sampled queries carry their blocks' pooled queries and take the naive reference.
        """
        if attn_mask is not None:
            raise ValueError(f"layer '{getattr(self, 'layer_name', '?')}': the piecewise kernel cannot honour a "
                             "general attention mask; calibrate it with kernel='latte'")
        spec = self.piecewise_spec()
        m, rho = self.m.view(-1, 1, 1), torch.exp(self.log_rho).view(-1, 1, 1)
        if q_pool is not None:
            return ops.naive_piecewise_attention(q, k, v, spec, m, rho, key_padding_mask, q_pool)
        triton = self.backend == "triton" or (self.backend in ("auto", "compiled") and q.is_cuda)
        return ops.piecewise_attention(q, k, v, spec, m, rho, key_padding_mask, "triton" if triton else "eager")

    def piecewise_spec(self) -> "ops.PiecewiseSpec":
        """This layer's piecewise knobs."""
        return ops.PiecewiseSpec(int(self.piecewise_top), float(self.piecewise_gamma), self.piecewise_rest,
                                 int(self.piecewise_block), self.piecewise_order)

    def correct(self, o: Tensor, v_own: Optional[Tensor] = None) -> Tensor:
        """The output correction of linear attention: sigma, then the refit if fitted, plus the
        diagonal term if fitted and ``v_own`` is given.

        Args:
            o: ``(..., H, N, d_v)``. v_own: ``(..., H, N, d_v)``, each query's own value
                (:func:`own_values`), or ``None`` (not self-attention: no diagonal term).
        Returns: the same shape as ``o``.
        """
        h, dv = o.shape[-3], o.shape[-1]
        out_dtype = o.dtype
        # in >= float32: fitted weights need not fit 16-bit ranges (a no-op for float32 inputs)
        o = o.to(torch.promote_types(out_dtype, torch.float32))
        o = o * self.sigma.view(h, 1, dv).to(o.dtype)
        if bool(self.refit_on):
            lead, n = o.shape[:-3], o.shape[-2]
            merged = o.transpose(-3, -2).reshape(-1, h * dv)  # (..., N, H*dv) rows (transpose: exports to ONNX)
            merged = torch.addmm(self.refit_bias.to(o.dtype), merged, self.refit_weight.to(o.dtype).t())
            if bool(self.diag_on) and v_own is not None:
                own = v_own.to(o.dtype).transpose(-3, -2).reshape(-1, h * dv)
                merged = torch.addmm(merged, own, self.diag_weight.to(o.dtype).t())
            o = merged.view(*lead, n, h, dv).transpose(-3, -2)
        return o.to(out_dtype)

    def use_linear(self, num_keys: int) -> bool:
        mode = self.mode
        return mode == "linear" or (mode == "dynamic" and num_keys >= int(self.threshold))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
               attn_mask: Optional[Tensor] = None) -> Tensor:
        """Attention in the current mode.

        Args:
            q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; v: ``(B, H, M, d_v)``.
            key_padding_mask: ``(B, M)`` bool, ``True`` = padded.
            attn_mask: ``(N, M)`` or ``(B, H, N, M)``, bool (``True`` = masked) or additive. Linear
                mode honours 0/-inf masks on a quadratic path and rejects other additive biases.

        Returns:
            ``(B, H, N, d_v)``.
        """
        if self.mode == "uniform":
            out = ops.uniform_attention(v, key_padding_mask, q.shape[-2])
        elif self.use_linear(k.shape[-2]):
            out = self.linear(q, k, v, key_padding_mask, ops.bool_attn_mask(attn_mask))
        else:
            out = ops.softmax_attention(q, k, v, key_padding_mask, attn_mask)
        return out

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        """:meth:`attend` through the module call, so that calibration's forward hooks see it."""
        return self.attend(q, k, v, key_padding_mask, attn_mask)

    @property
    def tapped(self) -> bool:
        """Whether a calibration tap (a forward hook) listens: adapters then keep the LATTE path."""
        return bool(self._forward_hooks)

    def extra_repr(self) -> str:
        kernel = f", piecewise top={int(self.piecewise_top)}" if self.kernel == "piecewise" else ""
        return (f"variant={self.variant}, mode={self.mode}, alpha={self.alpha:.4f}, calibrated={bool(self.calibrated)}, "
                f"backend={self.backend}{kernel}")


def own_values(q: Tensor, v: Tensor) -> Optional[Tensor]:
    """Each query's own value for the diagonal term: ``v`` ``(..., H, M, d_v)`` itself where the
    queries are the keys' tokens (self-attention: as many queries as keys), else ``None``."""
    return v if q.shape[-2] == v.shape[-2] else None


def merge_heads(o: Tensor) -> Tensor:
    """``(B, H, N, d_v)`` to ``(B, N, H * d_v)``."""
    b, h, n, dv = o.shape
    return o.transpose(1, 2).reshape(b, n, h * dv)
