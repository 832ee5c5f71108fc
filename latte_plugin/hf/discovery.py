"""Which attention layers of a transformers model LATTE may linearize, found by running it once.

Every module that dispatches through ``ALL_ATTENTION_FUNCTIONS`` is routed, for one forward
pass, to a recording implementation that calls the original one (outputs unchanged) and
notes what it saw: the shapes of q and k, the mask, and whether the module was handed rotary
position embeddings. Each layer is then classified:

* ``global``: softmax self-attention over every token of an image (N = M, one sequence per
  image): a **candidate**. With rotary embeddings (``global+rope``) the LATTE features are
  computed on the rotated q and k, which is what HF hands the attention function;
* ``windowed``: the model folded windows into the batch (more sequences than images, as
  LW-DETR's and RF-DETR's windowed ViT blocks do): **not** a candidate: a window holds few
  tokens, its cost is already bounded, and linear attention gains only when the sequence is
  long against the head width;
* ``cross``: queries attend to another sequence (N != M): kept exact (the method linearizes
  self-attention);
* ``bias``: the mask carries an additive bias other than 0 / -inf (relative-position bias,
  ALiBi): **refused**: the kernel cannot take it, and it is never linearized wrongly;
* ``unused``: the module did not run on the probe input.

Deformable attention (RT-DETR's decoder cross-attention, Deformable DETR's encoder) is not a
softmax over tokens and does not dispatch through ``ALL_ATTENTION_FUNCTIONS``: it stays exact
and is not listed.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from .attention import _fallback, is_hf_attention

__all__ = ["AttentionSite", "discover_attention", "detector_sites", "candidate_names", "KIND_REASONS"]

PROBE_IMPLEMENTATION = "latte_probe"

KIND_REASONS = {
    "global": "global softmax self-attention: candidate",
    "global+rope": "global softmax self-attention with rotary q/k (LATTE features on the rotated q, k): candidate",
    "windowed": "windowed (windows folded into the batch): not a candidate, its cost is already bounded",
    "cross": "cross-attention (queries attend to another sequence): kept exact",
    "bias": "refused: an additive attention bias the linear kernel cannot take",
    "unused": "did not run on the probe input",
}


@dataclass
class AttentionSite:
    """What one attention module saw in the probe forward.

    Attributes:
        name: module name in the model.
        kind: see :data:`KIND_REASONS`.
        tokens: keys per sequence (``M``); 0 if unused.
        sequences: sequences per image (1 for global attention, the window count for windowed).
        heads, head_dim: from q.
    """

    name: str
    kind: str = "unused"
    tokens: int = 0
    sequences: int = 0
    heads: int = 0
    head_dim: int = 0
    calls: list = field(default_factory=list, repr=False)

    @property
    def candidate(self) -> bool:
        return self.kind in ("global", "global+rope")

    @property
    def reason(self) -> str:
        return KIND_REASONS[self.kind]


def _has_bias(mask: Optional[Tensor]) -> bool:
    if mask is None or mask.dtype == torch.bool:
        return False
    very_neg = mask <= torch.finfo(mask.dtype).min / 2
    return not bool(((mask == 0) | very_neg).all())


def _recorder(sites: dict[int, AttentionSite], rotary: dict[int, bool]) -> Callable:
    def record(module, query, key, value, attention_mask, **kwargs):
        sites[id(module)].calls.append(dict(q=tuple(query.shape), k=tuple(key.shape), bias=_has_bias(attention_mask),
                                            rope=rotary.get(id(module), False)))
        return module._latte_probe_fallback(module, query, key, value, attention_mask, **kwargs)
    return record


def _rope_hook(rotary: dict[int, bool]) -> Callable:
    def hook(module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        rotary[id(module)] = isinstance(pe, (tuple, list)) and len(pe) == 2 and all(torch.is_tensor(t) for t in pe)
    return hook


@contextmanager
def _probing(modules: dict[str, nn.Module], sites: dict[int, AttentionSite]) -> Iterator[None]:
    from transformers import AttentionInterface

    rotary: dict[int, bool] = {}
    AttentionInterface.register(PROBE_IMPLEMENTATION, _recorder(sites, rotary))
    saved, hooks = {}, []
    try:
        for mod in modules.values():
            saved[id(mod)] = mod.config
            mod._latte_probe_fallback = _fallback(mod, mod.config._attn_implementation)
            cfg = copy.copy(mod.config)
            cfg._attn_implementation_internal = PROBE_IMPLEMENTATION
            mod.config = cfg
            hooks.append(mod.register_forward_pre_hook(_rope_hook(rotary), with_kwargs=True))
        yield
    finally:
        for mod in modules.values():
            mod.config = saved[id(mod)]
            del mod._latte_probe_fallback
        for h in hooks:
            h.remove()


def _classify(site: AttentionSite, images: int) -> None:
    if not site.calls:
        return
    call = site.calls[0]
    (bq, heads, n, d), (_, _, m, _) = call["q"], call["k"]
    site.tokens, site.heads, site.head_dim = m, heads, d
    site.sequences = max(1, bq // max(images, 1))
    if any(c["bias"] for c in site.calls):
        site.kind = "bias"
    elif bq > images:
        site.kind = "windowed"
    elif n != m:
        site.kind = "cross"
    else:
        site.kind = "global+rope" if call["rope"] else "global"


@torch.no_grad()
def discover_attention(model: nn.Module, run: Callable[[nn.Module], object], images: int,
                       prefix: str = "") -> list[AttentionSite]:
    """Classifies every HF attention module of ``model`` from one forward pass.

    Args:
        model: a transformers model (or a module holding one).
        run: runs the probe forward, e.g. ``lambda m: m(pixel_values=x)``.
        images: images in the probe batch (tells windows folded into the batch apart).
        prefix: prepended to each name (``"hf."`` for the framework wrappers).

    Returns:
        One :class:`AttentionSite` per attention module, in model order.
    """
    modules = {n: m for n, m in model.named_modules() if n and is_hf_attention(m)}
    sites = {id(m): AttentionSite(prefix + n) for n, m in modules.items()}
    was_training = model.training
    model.eval()
    try:
        with _probing(modules, sites):
            run(model)
    finally:
        model.train(was_training)
    for site in sites.values():
        _classify(site, images)
    return list(sites.values())


def detector_sites(hf: nn.Module, size: Optional[tuple[int, int]] = None, prefix: str = "") -> list[AttentionSite]:
    """:func:`discover_attention` for a transformers detector: one zero image of ``size`` (default:
    its family's smallest runnable square, ``Family.probe_size``)."""
    from .detectors import family_of

    side = family_of(hf).probe_size
    x = torch.zeros(1, 3, *(size or (side, side)), device=next(hf.parameters()).device)
    return discover_attention(hf, lambda m: m(pixel_values=x), images=1, prefix=prefix)


def candidate_names(sites: list[AttentionSite]) -> list[str]:
    """The candidates' names, in model order."""
    return [s.name for s in sites if s.candidate]
