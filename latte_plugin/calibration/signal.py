"""How much a model uses each attention layer: the change of its raw outputs when that one
layer's attention output is replaced by the mean of its values (``uniform`` mode), every other
layer exact.

A layer whose branch the network ignores scores ~0: linearizing it cannot lose accuracy, and
so it is no evidence that linear attention works; a layer the network needs scores high. The
figure is the relative raw-output distortion of :class:`~latte_plugin.calibration.measures.RawDistortion`
(squared change over the exact outputs' energy), summed over the images and across processes.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..nn.install import set_modes
from ..nn.params import LatteParams
from .measures import RawDistortion
from .taps import exact_taps

__all__ = ["attention_signal", "naive_attention_signal", "attention_entropy", "attention_sharpness"]


@torch.no_grad()
def attention_signal(layers: dict[str, LatteParams], batches: Sequence[Any], forward: Callable[[Any], Any],
                     all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict[str, float]:
    """``{layer: relative raw-output change with that layer uniform}``; the layers' modes are restored.

    Args:
        layers: the LATTE layers (:func:`~latte_plugin.nn.install.find_latte_layers`).
        batches: this process's images (one batch each).
        forward: runs one batch; returns raw outputs (tensors, nested ok).
        all_reduce: sums a tensor across processes in place (``None``: one process).
    """
    measure = RawDistortion(forward)
    saved = {name: layer.mode for name, layer in layers.items()}
    try:
        set_modes(layers, [])
        refs = [forward(b) for b in batches]
        out = {}
        for name in layers:
            set_modes(layers, [name], mode="uniform")
            total = measure.zeros()
            for batch, ref in zip(batches, refs):
                total += measure.sums(ref, forward(batch))
            if all_reduce is not None:
                all_reduce(total)
            out[name] = measure.loss(total)
        return out
    finally:
        for name, layer in layers.items():
            layer.mode = saved[name]


def naive_attention_signal(layer_output: Callable[[str, bool], torch.Tensor], names: Sequence[str]) -> dict[str, float]:
    """Reference: ``layer_output(name, uniform)`` gives the model's whole output with ``name`` made
    uniform (``True``) or with every layer exact (``False``); the same ratio, one layer at a time."""
    exact = layer_output("", False).double()
    return {n: float(((layer_output(n, True).double() - exact) ** 2).sum() / (exact ** 2).sum()) for n in names}


def attention_entropy(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None) -> float:
    """Mean entropy of the softmax attention rows over ``log(number of valid keys)``: 1 is uniform
    attention (every key weighted alike, what the uniform control substitutes), 0 is one key per query.

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``; key_padding_mask: ``(B, M)``, ``True`` = padded.
    """
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    valid = torch.full(k.shape[:1], k.shape[-2], dtype=torch.float64)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        valid = (~key_padding_mask).sum(-1).double()
    logp = torch.log_softmax(scores, dim=-1)
    rows = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)  # (B, H, N)
    return float((rows / valid.clamp_min(2).log()[:, None, None]).mean())


@torch.no_grad()
def attention_sharpness(layers: dict[str, LatteParams], batches: Sequence[Any],
                        forward: Callable[[Any], Any]) -> dict[str, float]:
    """``{layer: mean normalised attention entropy}`` of the exact model (:func:`attention_entropy`,
    averaged over the batches); the layers' modes are restored. Near 1 means the
    layer attends almost uniformly, so the uniform control barely changes it."""
    saved = {name: layer.mode for name, layer in layers.items()}
    entropies: dict[str, list[float]] = {name: [] for name in layers}  # one per forward of each layer
    taps = {name: (lambda q, k, v, kpm, out, _n=name, **kw: entropies[_n].append(attention_entropy(q, k, kpm)))
            for name in layers}
    try:
        set_modes(layers, [])
        with exact_taps(layers, taps):
            for batch in batches:
                forward(batch)
        return {name: sum(v) / len(v) for name, v in entropies.items() if v}
    finally:
        for name, layer in layers.items():
            layer.mode = saved[name]
