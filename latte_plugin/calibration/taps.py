"""Calibration's taps on LATTE layers: forward hooks registered for one pass and removed after
it, so the inference path (:class:`~latte_plugin.nn.params.LatteParams`) holds none.

* :func:`exact_taps`: ``tap(q, k, v, key_padding_mask, out[, attn_mask=bool mask])`` on every
  call that ran exact softmax attention (what the recorders and the entropy measure see);
* :func:`output_taps`: ``tap(out)`` with the layer's output ``(B, N, H * d_v)`` on every call
  (what the sensitivity score compares).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator

from torch import Tensor

from .. import ops
from ..nn.params import LatteParams, merge_heads

__all__ = ["exact_taps", "output_taps"]

_ARGS = ("q", "k", "v", "key_padding_mask", "attn_mask")


def _bound(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (``LatteParams.forward``'s signature)."""
    bound = dict.fromkeys(_ARGS)
    bound.update(zip(_ARGS, args))
    bound.update(kwargs)
    return bound


def _on_exact(tap: Callable[..., None], layer: LatteParams, args: tuple, kwargs: dict, out: Tensor) -> None:
    a = _bound(args, kwargs)
    if layer.mode == "uniform" or layer.use_linear(a["k"].shape[-2]):
        return
    masked = ops.bool_attn_mask(a["attn_mask"])
    if masked is None:
        tap(a["q"], a["k"], a["v"], a["key_padding_mask"], out)
    else:
        tap(a["q"], a["k"], a["v"], a["key_padding_mask"], out, attn_mask=masked)


def _on_output(tap: Callable[[Tensor], None], layer: LatteParams, args: tuple, kwargs: dict, out: Tensor) -> None:
    tap(merge_heads(out))


@contextmanager
def _hooks(layers: dict[str, LatteParams], taps: dict[str, Callable], on: Callable) -> Iterator[None]:
    handles = [layers[n].register_forward_hook(partial(on, tap), with_kwargs=True) for n, tap in taps.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def exact_taps(layers: dict[str, LatteParams], taps: dict[str, Callable[..., None]]):
    """A context in which ``taps[name]`` sees every exact call of layer ``name``."""
    return _hooks(layers, taps, _on_exact)


def output_taps(layers: dict[str, LatteParams], taps: dict[str, Callable[[Tensor], None]]):
    """A context in which ``taps[name]`` sees every output of layer ``name``, heads merged."""
    return _hooks(layers, taps, _on_output)
