"""Finding a model's LATTE layers and setting them: candidates by pattern, modes, kernel
backends, saved states. Plain functions over :class:`~latte_plugin.nn.params.LatteParams`."""
from __future__ import annotations

import fnmatch
from typing import Iterable, Optional, Sequence

from torch import Tensor, nn

from .. import ops
from .params import LatteParams

__all__ = ["match_candidates", "find_latte_layers", "set_modes", "set_backend", "layer_states",
           "restore_layer_states"]


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


def set_backend(model: nn.Module, backend: Optional[str] = None) -> None:
    """Gives every LATTE layer of ``model`` the kernel backend ``backend`` (resolved once here, as
    at construction: ``None`` reads ``LATTE_KERNEL``, else ``auto``)."""
    name = ops.resolve_backend(backend)
    for layer in find_latte_layers(model).values():
        layer.backend = name
