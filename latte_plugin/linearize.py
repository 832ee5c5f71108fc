"""The framework-free entry point: ``latte_plugin.linearize(model, calib_batches, ...)``.

Works on any ``torch.nn.Module`` whose candidate attention modules are
``torch.nn.MultiheadAttention`` (or wrappers holding one as ``.attn``) or HF
``transformers`` attention modules (ViT, CLIP, BERT/RoBERTa, RT-DETR, ...). It runs the
whole flow of ``ARCHITECTURE.md`` (swap -> record -> fit -> score -> select) through
:func:`latte_plugin.core.flow.calibrate_model`, the same function the mmdet and
detectron2 adapters call, and returns the same report as ``tools/calibrate.py``.

Example::

    from transformers import ViTConfig, ViTModel
    import latte_plugin

    model = ViTModel(ViTConfig(num_hidden_layers=6)).eval()
    batches = [{"pixel_values": torch.randn(2, 3, 224, 224)} for _ in range(8)]
    model, report = latte_plugin.linearize(
        model, batches, candidates=["encoder.layer.*.attention.attention"], ratio=0.67)
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from .console import progress as console_progress
from .core.flow import LatteConfig, calibrate_model, match_candidates, needs_calibration
from .core.mha import swap_attention as swap_mha

__all__ = ["swap_attention", "linearize", "default_forward"]


def _is_mha(mod: nn.Module) -> bool:
    return isinstance(mod, nn.MultiheadAttention) or isinstance(getattr(mod, "attn", None), nn.MultiheadAttention)


def swap_attention(model: nn.Module, patterns: Sequence[str], variant: str = "latte") -> list[str]:
    """Installs a LATTE core in every attention module named by ``patterns`` (idempotent).

    ``nn.MultiheadAttention`` modules are replaced by :class:`~latte_plugin.core.LatteMultiheadAttention`
    (same parameters); HF attention modules keep their class and get a ``latte`` child.
    In exact mode the model's outputs are unchanged.

    Returns:
        The matched module names, in model order.

    Raises:
        ValueError: a pattern matching nothing, or a matched module of an unsupported kind.
    """
    modules = dict(model.named_modules())
    names = match_candidates([n for n in modules if n], patterns)
    mha_names = [n for n in names if _is_mha(modules[n])]
    if mha_names:
        swap_mha(model, mha_names, variant)
    for name in names:
        if name in mha_names:
            continue
        mod = modules[name]
        try:
            from .hf.attention import install_latte, is_hf_attention
        except ImportError:  # transformers missing
            is_hf_attention = None
        if is_hf_attention is None or not is_hf_attention(mod):
            raise ValueError(
                f"module {name!r} ({type(mod).__name__}) matched a candidate pattern but is neither an "
                "nn.MultiheadAttention (or a wrapper holding one as .attn) nor an HF transformers attention "
                "module; narrow the pattern to the attention modules themselves"
            )
        layer = install_latte(mod, variant)
        layer.variant = variant
        layer.layer_name = name
    return names


def default_forward(model: nn.Module) -> Callable[[Any], Any]:
    """Runs one calibration batch: ``model(**batch)`` for a dict, ``model(*batch)`` for a
    tuple/list, ``model(batch)`` otherwise. Tensors are moved to the model's device."""
    device = next(iter(model.parameters())).device

    def to(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def forward(batch: Any) -> Any:
        if isinstance(batch, dict):
            return model(**{k: to(v) for k, v in batch.items()})
        if isinstance(batch, (tuple, list)):
            return model(*[to(v) for v in batch])
        return model(to(batch))

    return forward


@torch.no_grad()
def linearize(
    model: nn.Module,
    calib_batches: Iterable[Any],
    candidates: Sequence[str] = ("*self_attn",),
    ratio: Optional[float] = 0.67,
    variant: str = "latte",
    forward: Optional[Callable[[Any], Any]] = None,
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
    **settings: Any,
) -> tuple[nn.Module, dict]:
    """Calibrates LATTE on ``model`` without training and makes ``ratio`` of the candidates linear.

    Args:
        model: any module; changed in place (and returned) as the hybrid model.
        calib_batches: unlabeled batches; an iterable (possibly endless: at most
            ``settings['num_images']`` batches are taken, default 64).
        candidates: ``fnmatch`` patterns over module names naming attention modules.
        ratio: fraction of candidates made linear (or pass ``num_linear=``).
        variant: ``latte`` (default), ``jpn_only``, ``tte_only`` or ``qtvit``.
        forward: runs one batch on the model; default :func:`default_forward`.
        all_reduce: sums a float64 tensor across ranks in place (distributed runs).
        log: receives progress lines. progress: show a progress bar (``rich``).
        **settings: any other :class:`~latte_plugin.core.LatteConfig` field (``selection``,
            ``steps``, ``correction``, ``holdout``, ``calibrate='auto'|'always'|'never'``, ...).

    Returns:
        ``(model, report)``, the report as written by ``tools/calibrate.py`` (``None`` when
        ``calibrate='auto'`` found the model already calibrated).

    Raises:
        ValueError: unknown setting, a pattern matching nothing, an empty calibration set.
    """
    cfg = LatteConfig.from_dict(dict(candidates=list(candidates), ratio=ratio, variant=variant, **settings))
    swap_attention(model, cfg.candidates, cfg.variant)
    if not needs_calibration(model, cfg.calibrate):  # calibrate='auto' on a calibrated model: keep its state
        log("[latte] the model already holds calibrated LATTE state (calibrate='auto'): kept as is")
        return model, None
    batches = list(itertools.islice(iter(calib_batches), cfg.num_images))
    if not batches:
        raise ValueError("empty calibration set: calib_batches yielded no batch; give at least one batch")
    report = calibrate_model(
        model, batches, forward or default_forward(model), cfg, all_reduce=all_reduce, log=log,
        progress=console_progress if progress else (lambda it, total, desc: it),
    )
    return model, report
