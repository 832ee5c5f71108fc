"""Per-layer LATTE state and the dispatch between exact, linear and dynamic attention.

:class:`LatteParams` holds the calibrated scalars of one attention layer as buffers, so
they travel in an ordinary ``state_dict`` (and load with ``weights_only=True``). A framework
adapter projects q, k, v itself and calls :meth:`LatteParams.attend`; nothing here knows
about mmdet or detectron2.
"""
from __future__ import annotations

import fnmatch
import math
import os
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import kernels

__all__ = ["MODES", "LatteParams", "merge_heads", "match_candidates", "find_latte_layers", "set_modes", "layer_states", "restore_layer_states"]

#: ``exact`` = softmax; ``linear`` = LATTE; ``dynamic`` = softmax below ``threshold`` keys;
#: ``uniform`` = the mean of the values (a control that shows how much attention matters).
MODES = ("exact", "linear", "dynamic", "uniform")


def _fastpath_guard(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook. Its presence stops ``nn.TransformerEncoderLayer``'s fused
    inference fast path, which would call torch's native attention kernel and bypass the
    LATTE core of a swapped ``self_attn`` (the layer checks for hooks on all submodules)."""
    return None


def _triton_ready(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the Triton kernel takes this call (installed, not turned off, supported shapes and dtypes)."""
    try:
        from . import triton_latte
    except ImportError:  # pragma: no cover
        return False
    return triton_latte.available() and triton_latte.supported(q, k, v)


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
        variant: one of :data:`kernels.VARIANTS`.
        mode: one of :data:`MODES`.
        threshold: for ``dynamic`` mode, the key count below which softmax is used.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, variant: str = "latte", mode: str = "exact", threshold: int = 0
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
        self.register_buffer("variant_id", torch.tensor(0, dtype=torch.long))
        self.register_buffer("mode_id", torch.tensor(0, dtype=torch.long))
        self.register_buffer("threshold", torch.tensor(int(threshold), dtype=torch.long))
        self.register_buffer("calibrated", torch.tensor(False))
        self.variant = variant
        self.mode = mode
        #: Set by calibration to receive ``(q, k, v, key_padding_mask, exact_output)``.
        self.recorder: Optional[Callable[..., None]] = None
        #: Set by sensitivity scoring to receive this layer's output ``(B, N, C)``.
        self.probe: Optional[Callable[[Tensor], None]] = None
        self.register_forward_pre_hook(_fastpath_guard)

    # -- names <-> buffers -------------------------------------------------------------
    @property
    def variant(self) -> str:
        return kernels.VARIANTS[int(self.variant_id)]

    @variant.setter
    def variant(self, name: str) -> None:
        if name not in kernels.VARIANTS:
            raise ValueError(f"unknown LATTE variant {name!r}; choose one of {', '.join(kernels.VARIANTS)}")
        self.variant_id.fill_(kernels.VARIANTS.index(name))

    @property
    def mode(self) -> str:
        return MODES[int(self.mode_id)]

    @mode.setter
    def mode(self, name: str) -> None:
        if name not in MODES:
            raise ValueError(f"unknown attention mode {name!r}; choose one of {', '.join(MODES)}")
        self.mode_id.fill_(MODES.index(name))

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
        return kernels.variant_features(q, k, self.variant, m, delta, delta, 1.0, 1.0)

    def linear(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """LATTE linear attention with sigma applied: ``(B, H, N, d_v)``.

        ``latte`` and ``jpn_only`` run the fused fast path (the Triton kernel on CUDA tensors,
        :mod:`.triton_latte`; elsewhere the eager fused function, or with ``LATTE_KERNEL=compiled``
        the same function through ``torch.compile``); the others (and calibration, via
        :meth:`features`) use the reference composition it is tested against. A general
        ``attn_mask`` (bool, ``True`` = masked, e.g. causal) takes the quadratic masked path.
        """
        variant = self.variant
        if attn_mask is None and variant in ("latte", "jpn_only"):
            m = self.m.view(-1, 1, 1) if variant == "latte" else 1.0
            rho = torch.exp(self.log_rho).view(-1, 1, 1)
            if q.is_cuda and _triton_ready(q, k, v):  # the fused GPU kernel (LATTE_KERNEL=eager turns it off)
                from . import triton_latte

                o = triton_latte.triton_latte_attention(q, k, v, m, rho, key_padding_mask)
            elif os.environ.get("LATTE_KERNEL") == "compiled" and not torch.jit.is_tracing():
                # the same function through torch.compile: faster on CPU from ~4k tokens (docs/deployment.md)
                o = kernels.compiled_fused_latte_attention()(q, k, v, m, rho, key_padding_mask)
            else:
                o = kernels.fused_latte_attention(q, k, v, m, rho, key_padding_mask)
        else:
            # feature maps in >= float32: squared features overflow float16 at large activations
            acc = torch.promote_types(q.dtype, torch.float32)
            fq, fk = self.features(q.to(acc), k.to(acc))
            if attn_mask is None:
                o = kernels.linear_attention(fq, fk, v, key_padding_mask)
            else:
                o = kernels.naive_linear_attention(fq, fk, v.to(acc), key_padding_mask, attn_mask).to(v.dtype)
        return self.correct(o)

    def correct(self, o: Tensor) -> Tensor:
        """The output correction of linear attention: sigma, then the refit if fitted.

        Args:
            o: ``(..., H, N, d_v)``. Returns: the same shape.
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
            out = kernels.uniform_attention(v, key_padding_mask, q.shape[-2])
        elif self.use_linear(k.shape[-2]):
            out = self.linear(q, k, v, key_padding_mask, kernels.bool_attn_mask(attn_mask))
        else:
            out = kernels.softmax_attention(q, k, v, key_padding_mask, attn_mask)
            if self.recorder is not None:
                masked = kernels.bool_attn_mask(attn_mask)
                if masked is None:
                    self.recorder(q, k, v, key_padding_mask, out)
                else:
                    self.recorder(q, k, v, key_padding_mask, out, attn_mask=masked)
        if self.probe is not None:
            self.probe(merge_heads(out))
        return out

    def extra_repr(self) -> str:
        return f"variant={self.variant}, mode={self.mode}, alpha={self.alpha:.4f}, calibrated={bool(self.calibrated)}"


def merge_heads(o: Tensor) -> Tensor:
    """``(B, H, N, d_v)`` to ``(B, N, H * d_v)``."""
    b, h, n, dv = o.shape
    return o.transpose(1, 2).reshape(b, n, h * dv)


def match_candidates(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """Module names matching any pattern, in model order.

    Raises:
        ValueError: if a pattern matches nothing (names it and shows a few module names).
    """
    names = list(names)
    out = []
    for pat in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            # show attention-looking names first: what the user most likely meant
            att = [n for n in names if "attn" in n.split(".")[-1] or "attention" in n.split(".")[-1]]
            sample = ", ".join((att or names)[:8])
            raise ValueError(f"candidate pattern {pat!r} matches no attention module; available: {sample} ...")
        out.extend(h for h in hits if h not in out)
    return [n for n in names if n in out]


def find_latte_layers(model: nn.Module) -> dict[str, LatteParams]:
    """``{attention module name: its LatteParams}`` in model order (the ``.latte`` suffix stripped)."""
    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LatteParams):
            default = name[: -len(".latte")] if name.endswith(".latte") else name
            layers[getattr(mod, "layer_name", default)] = mod
    return layers


def set_modes(layers: dict[str, LatteParams], linear: Iterable[str], mode: str = "linear") -> None:
    """Puts ``linear`` layers in ``mode`` and every other layer in exact mode."""
    linear = set(linear)
    for name, layer in layers.items():
        layer.mode = mode if name in linear else "exact"


def layer_states(layers: dict[str, LatteParams]) -> dict[str, dict[str, Tensor]]:
    """A copy of every layer's buffers (its whole calibrated state)."""
    return {n: {key: t.clone() for key, t in layer.state_dict().items()} for n, layer in layers.items()}


def restore_layer_states(layers: dict[str, LatteParams], states: dict[str, dict[str, Tensor]]) -> None:
    """Loads :func:`layer_states`' copies back."""
    for n, layer in layers.items():
        layer.load_state_dict(states[n])
