"""The cost model behind ``speedup=`` and ``choose_for='speed'`` (``docs/method.md#speed``).

Each candidate layer's attention is timed, on this machine, at the shapes it saw in one exact
forward of a calibration batch (so at the input size the calibration images have: the config's
test size), in every mode it can take: ``exact`` (softmax), ``latte`` and ``piecewise@<top>``.
The exact model's end-to-end time of that batch completes the profile: an assignment of modes
saves, per layer, the difference between its exact and its mode's time, and its predicted
end-to-end speed-up is ``T_exact / (T_exact - saved)``. The measured speed-up of the chosen
assignment (:func:`measured_speedup`) is reported beside the prediction.

A layer timed alone on random inputs is not the same layer inside the model's forward (caches,
memory traffic, the process's state): at 8,101 tokens the isolated timings put the ViT blocks'
softmax about 10% below what switching them saves end to end. So the exact model and the fastest
assignment are timed end to end in alternation, and the layers' savings are scaled by one factor
(:func:`anchor_scale`) that makes the fastest assignment's prediction equal its measurement.
"""
from __future__ import annotations

import fnmatch
import json
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..nn.install import layer_states, restore_layer_states, set_modes
from ..nn.params import LatteParams
from ..ops.piecewise import similarity_groups
from .config import PIECEWISE_TOPS
from .taps import exact_taps

__all__ = ["CallShape", "CostModel", "call_shapes", "layer_modes", "time_ms", "time_layer", "measure_costs",
           "measured_speedup", "anchor_scale", "load_cost_model", "set_mode", "EXACT", "LATTE", "piecewise_mode",
           "mode_top"]

EXACT, LATTE = "exact", "latte"
#: Timed repetitions (medians) of one layer call and of one model forward; a layer's calls are
#: repeated until they took LAYER_MIN_MS together.
LAYER_REPS, MODEL_REPS, LAYER_MIN_MS = 5, 5, 50.0
#: The end-to-end anchor: (exact, fastest) pairs are timed until they took ANCHOR_MIN_MS together
#: (at most ANCHOR_MAX_REPS pairs); the savings are scaled only where the fastest assignment's
#: predicted saving is at least ANCHOR_MIN_SHARE of the exact time (smaller ones drown in the
#: timing noise), and by at most ANCHOR_LIMIT either way.
ANCHOR_MIN_MS, ANCHOR_MAX_REPS, ANCHOR_MIN_SHARE, ANCHOR_LIMIT = 4000.0, 25, 0.1, 1.5


def piecewise_mode(top: int) -> str:
    """The name of the piecewise mode with ``top`` exact key blocks per query block."""
    return f"piecewise@{int(top)}"


def mode_top(mode: str) -> Optional[int]:
    """``top`` of a ``piecewise@<top>`` mode; ``None`` for the others."""
    return int(mode.split("@", 1)[1]) if mode.startswith("piecewise@") else None


@dataclass(frozen=True)
class CallShape:
    """One call of a layer in the exact forward: ``q (B, H, N, d)``, ``k (B, H, M, d)``,
    ``v (B, H, M, d_v)``, whether a key padding mask came with it, and the tensors' dtype."""

    batch: int
    heads: int
    queries: int
    keys: int
    dim: int
    dim_v: int
    padded: bool = False
    masked: bool = False
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def call_shapes(layers: Mapping[str, LatteParams], batch: Any, forward: Callable[[Any], Any]) -> dict[str, list[CallShape]]:
    """``{layer: [CallShape of each call]}`` in one exact forward of ``batch``."""
    shapes: dict[str, list[CallShape]] = {n: [] for n in layers}

    def tap(name: str):
        def seen(q: Tensor, k: Tensor, v: Tensor, kpm: Optional[Tensor], out: Tensor, attn_mask=None) -> None:
            shapes[name].append(CallShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                                          kpm is not None, attn_mask is not None, q.dtype, str(q.device)))
        return seen

    set_modes(dict(layers), [])
    with exact_taps(dict(layers), {n: tap(n) for n in layers}):
        forward(batch)
    return shapes


def layer_modes(calls: Sequence[CallShape], block: int, order: str, tops: Sequence[int] = PIECEWISE_TOPS) -> list[str]:
    """The non-exact modes a layer can take at these calls: ``latte``, and ``piecewise@<top>`` for
    every top that leaves some key approximated (none where a general mask came)."""
    if not calls:
        return []
    modes = [LATTE]
    if any(c.masked for c in calls):
        return modes
    most = max(similarity_groups(c.keys, block, order)[0] for c in calls)
    return modes + [piecewise_mode(t) for t in tops if t < most]


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 1, min_ms: float = 0.0, max_reps: int = 64) -> float:
    """Median wall time of ``fn()`` in milliseconds over at least ``reps`` runs after ``warmup``
    runs, more (up to ``max_reps``) until the runs took ``min_ms`` together (short calls are noisy)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < max(1, reps) or (sum(times) < min_ms and len(times) < max_reps):
        _synchronize()
        t0 = time.perf_counter()
        fn()
        _synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _synchronize() -> None:
    """Waits for queued GPU work (CUDA calls return before their kernels finish); nothing on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def set_mode(layer: LatteParams, mode: str, knobs: Mapping[str, Any]) -> None:
    """Puts ``layer`` in ``mode`` (piecewise with the layer's block, order and rest, gamma 1: the
    cost does not depend on gamma)."""
    if mode == EXACT:
        layer.mode = "exact"
        return
    layer.mode = "linear"
    top = mode_top(mode)
    if top is None:
        layer.kernel = "latte"
    else:
        layer.set_piecewise(top, 1.0, knobs["rest"], knobs["block"], knobs["order"])


def _inputs(c: CallShape, gen: torch.Generator) -> tuple[Tensor, ...]:
    q = torch.randn(c.batch, c.heads, c.queries, c.dim, generator=gen).to(c.device, c.dtype)
    k = torch.randn(c.batch, c.heads, c.keys, c.dim, generator=gen).to(c.device, c.dtype)
    v = torch.randn(c.batch, c.heads, c.keys, c.dim_v, generator=gen).to(c.device, c.dtype)
    kpm = torch.zeros(c.batch, c.keys, dtype=torch.bool, device=c.device) if c.padded else None
    return q, k, v, kpm


def whole_network(forward: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The forward that runs every module each call, for timing: an adapter's forward may
    memoise work no LATTE layer changes (mmdet's backbone features) and says so with ``.uncached``."""
    return getattr(forward, "uncached", forward)


@torch.no_grad()
def time_layer(layer: LatteParams, calls: Sequence[CallShape], modes: Sequence[str], knobs: Mapping[str, Any],
               reps: int = LAYER_REPS) -> dict[str, float]:
    """``{mode: ms}``: the summed median time of the layer's calls in each mode (``exact`` first),
    on random inputs of the recorded shapes; the layer's state is restored afterwards."""
    saved = layer_states({"l": layer})
    gen = torch.Generator().manual_seed(0)
    inputs = [_inputs(c, gen) for c in calls]
    out = {}
    try:
        for mode in [EXACT, *modes]:
            set_mode(layer, mode, knobs)
            out[mode] = sum(time_ms(lambda a=a: layer.attend(*a), reps, min_ms=LAYER_MIN_MS) for a in inputs)
    finally:
        restore_layer_states({"l": layer}, saved)
    return out


@dataclass(frozen=True)
class CostModel:
    """The exact model's time profile at the calibration input size.

    Attributes:
        exact_ms: the exact model's end-to-end time of one calibration batch (median).
        layers: ``{layer: {mode: ms per forward}}``, ``exact`` included, as timed alone.
        shapes: ``{layer: [CallShape]}`` the times were measured at.
        scale: the factor on every isolated saving that makes the fastest assignment's prediction
            equal its end-to-end measurement (:func:`anchor_scale`; 1: not anchored).
        anchor: that measurement (``assignment``, ``exact_ms``, ``hybrid_ms``, ``speedup``,
            ``unscaled_speedup``), or ``None``.
    """

    exact_ms: float
    layers: Mapping[str, Mapping[str, float]]
    shapes: Mapping[str, Sequence[CallShape]] = field(default_factory=dict, repr=False)
    scale: float = 1.0
    anchor: Optional[Mapping[str, Any]] = None

    def saving(self, layer: str, mode: str) -> float:
        """Milliseconds per forward that ``mode`` saves on ``layer`` (negative: it is slower)."""
        costs = self.layers[layer]
        return 0.0 if mode == EXACT else self.scale * (costs[EXACT] - costs[mode])

    def predicted_speedup(self, assignment: Mapping[str, str]) -> float:
        """``T_exact / (T_exact - saved)`` of an assignment ``{layer: mode}`` (unnamed layers exact)."""
        saved = sum(self.saving(n, m) for n, m in assignment.items())
        return self.exact_ms / max(self.exact_ms - saved, 1e-9)

    def fastest(self) -> dict[str, str]:
        """Every layer in its cheapest mode (exact where no mode saves time)."""
        best = {n: max(costs, key=lambda m: self.saving(n, m)) for n, costs in self.layers.items()}
        return {n: m for n, m in best.items() if m != EXACT}

    def entry(self) -> dict:
        return {"exact_ms": self.exact_ms, "layers_ms": {n: dict(c) for n, c in self.layers.items()},
                "attention_exact_ms": sum(c[EXACT] for c in self.layers.values()),
                "shapes": {n: [[c.batch, c.heads, c.queries, c.keys, c.dim] for c in cs] for n, cs in self.shapes.items()},
                "ceiling_speedup": self.predicted_speedup({n: min(c, key=c.get) for n, c in self.layers.items()
                                                           if min(c, key=c.get) != EXACT}),
                "max_speedup": self.predicted_speedup(self.fastest()), "scale": self.scale,
                **({"anchor": dict(self.anchor)} if self.anchor else {})}


@torch.no_grad()
def measure_costs(layers: Mapping[str, LatteParams], batch: Any, forward: Callable[[Any], Any],
                  knobs: Mapping[str, Any], modes: Optional[Mapping[str, Sequence[str]]] = None) -> CostModel:
    """The :class:`CostModel` of ``layers`` at ``batch``'s size: one exact forward records the calls'
    shapes, each layer is timed in each of its modes (``modes[layer]``; default: :func:`layer_modes`),
    and the exact model and the fastest assignment are timed end to end in alternation (the
    anchor that scales the savings).

    Args:
        knobs: the piecewise ``block``, ``order`` and ``rest`` of the calibration's settings.
    """
    shapes = call_shapes(layers, batch, forward)
    per_layer = {}
    for n, layer in layers.items():
        ms = modes[n] if modes is not None else layer_modes(shapes[n], knobs["block"], knobs["order"])
        per_layer[n] = time_layer(layer, shapes[n], ms, knobs) if shapes[n] else {EXACT: 0.0}
    set_modes(dict(layers), [])
    isolated = CostModel(0.0, per_layer, shapes)
    fastest = isolated.fastest()
    if not fastest:
        return CostModel(time_ms(lambda: forward(batch), MODEL_REPS), per_layer, shapes)
    saved = layer_states(dict(layers))
    try:
        def switch(on: bool) -> None:
            set_modes(dict(layers), [])
            for n, m in (fastest.items() if on else ()):
                set_mode(layers[n], m, knobs)
        got = measured_speedup(lambda: forward(batch), switch, min_ms=ANCHOR_MIN_MS, max_reps=ANCHOR_MAX_REPS)
    finally:
        restore_layer_states(dict(layers), saved)
        set_modes(dict(layers), [])
    unscaled = replace(isolated, exact_ms=got["exact_ms"])
    scale = anchor_scale(got["exact_ms"], got["hybrid_ms"], sum(unscaled.saving(n, m) for n, m in fastest.items()))
    anchor = {"assignment": dict(fastest), **got, "unscaled_speedup": unscaled.predicted_speedup(fastest)}
    return replace(unscaled, scale=scale, anchor=anchor)


def anchor_scale(exact_ms: float, hybrid_ms: float, predicted_saving_ms: float) -> float:
    """The factor on the isolated savings that makes an assignment's predicted end-to-end time
    ``exact_ms - scale * predicted_saving_ms`` equal its measured ``hybrid_ms``.

    1 where the predicted saving is below ``ANCHOR_MIN_SHARE`` of ``exact_ms`` (the measurement
    cannot resolve it) or a time is not positive; else clamped to ``[1/ANCHOR_LIMIT, ANCHOR_LIMIT]``.
    """
    if not (exact_ms > 0 and hybrid_ms > 0) or predicted_saving_ms < ANCHOR_MIN_SHARE * exact_ms:
        return 1.0
    return min(max((exact_ms - hybrid_ms) / predicted_saving_ms, 1.0 / ANCHOR_LIMIT), ANCHOR_LIMIT)


@torch.no_grad()
def measured_speedup(forward: Callable[[], Any], switch: Callable[[bool], None], reps: int = MODEL_REPS,
                     min_ms: float = 0.0, max_reps: int = MODEL_REPS) -> dict:
    """The measured end-to-end speed-up: ``forward()`` timed with ``switch(False)`` (exact) and
    ``switch(True)`` (the assignment) in alternation, ``reps`` times each, more (up to
    ``max_reps``) until the runs took ``min_ms`` together; medians.

    Returns:
        ``{"exact_ms", "hybrid_ms", "speedup", "reps"}``; the model is left with ``switch(True)``.
    """
    exact, hybrid = [], []
    for on in (False, True):  # one warm-up of each
        switch(on)
        forward()
    while len(exact) < max(1, reps) or (sum(exact) + sum(hybrid) < min_ms and len(exact) < max_reps):
        for on, acc in ((False, exact), (True, hybrid)):
            switch(on)
            acc.append(time_ms(forward, 1, warmup=0))
    switch(True)
    e, h = statistics.median(exact), statistics.median(hybrid)
    return {"exact_ms": e, "hybrid_ms": h, "speedup": e / h if h > 0 else float("nan"), "reps": len(exact)}


def load_cost_model(path: str, layers: Sequence[str]) -> CostModel:
    """A :class:`CostModel` from a JSON file (``{"exact_ms": float, "layers_ms": {layer or fnmatch
    pattern: {mode: ms}}, "scale": float (optional, default 1)}``, e.g. a report's ``speed.cost``):
    each layer takes the first key that names or matches it.

    Raises:
        ValueError: an unreadable file, or a layer no key matches (named, with the file).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        exact_ms, table, scale = float(data["exact_ms"]), dict(data["layers_ms"]), float(data.get("scale", 1.0))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cost_model {path}: not a cost model ({e}); give {{\"exact_ms\": ..., \"layers_ms\": "
                         "{layer: {mode: ms}}}, e.g. a report's speed.cost") from None
    out = {}
    for n in layers:
        key = n if n in table else next((k for k in table if fnmatch.fnmatchcase(n, k)), None)
        if key is None:
            raise ValueError(f"cost_model {path}: no entry names or matches layer '{n}'; add it (or a pattern) "
                             "under layers_ms")
        if EXACT not in table[key]:
            raise ValueError(f"cost_model {path}: layers_ms['{key}'] has no 'exact' time")
        bad = [m for m in table[key] if m not in (EXACT, LATTE) and not (m.startswith("piecewise@")
                                                                         and m.split("@", 1)[1].isdigit())]
        if bad:
            raise ValueError(f"cost_model {path}: layers_ms['{key}'] has unknown mode(s) {bad}; modes are exact, "
                             "latte and piecewise@<top>")
        out[n] = {m: float(v) for m, v in table[key].items()}
    return CostModel(exact_ms, out, scale=scale)
