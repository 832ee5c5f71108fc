"""The whole training-free flow on any model whose candidate layers carry :class:`LatteParams`.

Steps (``../shared/ARCHITECTURE.md``): record -> fit -> score -> select. A framework adapter
supplies the model (already swapped), a list of calibration batches, a ``forward``
callable that runs one batch, and an ``all_reduce`` for distributed runs; it decides
*when* to call :func:`calibrate_model`.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import flops as flops_mod
from .calibration import AllReduce, LayerRecorder, fit_layer
from .kernels import VARIANTS
from .layer import MODES, LatteParams
from .selection import SensitivityStats, backward_select, greedy_select, num_linear_layers, select_by_score

__all__ = [
    "LatteConfig",
    "find_latte_layers",
    "match_candidates",
    "set_modes",
    "calibrate_model",
    "attention_gflops",
]

SELECTIONS = ("score", "greedy", "backward")
#: Ridge strength used when nothing is held out to choose it: held-out data chose 0.01 for
#: most DETR layers and 0.001 for every RT-DETR layer (README, Results); 0.01 is the more
#: cautious of the two (stronger regularisation overfits less).
REFIT_FALLBACK = 0.01


@dataclass
class LatteConfig:
    """Everything a user sets for LATTE; the same keys appear in mmdet and detectron2 configs.

    Attributes:
        candidates: ``fnmatch`` patterns over module names, e.g. ``'encoder.layers.*.self_attn'``.
        ratio: fraction of candidates made linear (ignored when ``num_linear`` is set).
        num_linear: exact number of candidates made linear.
        variant: one of ``qtvit``, ``jpn_only``, ``tte_only``, ``latte``.
        num_images: calibration images taken from the train split.
        max_items, max_queries: recording bounds per layer (images, query tokens per image).
        steps, lr: the per-layer fit's maximum L-BFGS iterations and step scale; with held-out
            images the iteration count is chosen on them (among 0, 5, 10, 20, 40, 80 up to ``steps``).
        fit_sigma: fit the output rescaling sigma (the paper's diagonal correction).
        refit: fit a ridge-regularised full refit of each layer's output instead of sigma
            (beyond the paper; the default, since it won on held-out data: README); the ridge
            strength is chosen on held-out images among ``refit_reg`` (with no held-out
            images, :data:`REFIT_FALLBACK`).
        refit_reg: candidate ridge strengths (relative to the input energy).
        holdout: fraction of the calibration batches held out from fitting and selection; the
            knobs above are chosen on them and the report gives held-out errors. 0 disables.
        per_head: fit one (alpha, rho) per head instead of one per layer (beyond the paper).
        sequential: fit layer l on inputs from the model with layers < l already linear.
        selection: ``greedy`` (global: add the layer that hurts the model's final output least),
            ``backward`` (global: start all-linear, restore the most harmful layer to exact
            until ``k`` remain) or ``score`` (the paper's per-layer score with ``lam``).
        lam: lambda of the sensitivity score.
        greedy_images: calibration images used by greedy selection.
        mode: mode of the selected layers, ``linear`` or ``dynamic``.
        threshold: key count below which ``dynamic`` layers use softmax (default from the
            measured CPU crossover; re-measure on your hardware).
        seed: seeds the recorders' sampling.
    """

    candidates: Sequence[str] = ("encoder.layers.*.self_attn",)
    ratio: Optional[float] = 0.67
    num_linear: Optional[int] = None
    variant: str = "latte"
    num_images: int = 64
    max_items: int = 64
    max_queries: int = 128
    steps: int = 20
    lr: float = 1.0
    fit_sigma: bool = True
    refit: bool = True
    refit_reg: Sequence[float] = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
    holdout: float = 0.25
    per_head: bool = False
    sequential: bool = False
    selection: str = "greedy"
    lam: float = 10.0
    greedy_images: int = 8
    mode: str = "linear"
    # Crossover measured by benchmarks/attention.py on 2 idle CPU cores (fp32, 8 heads of 32):
    # LATTE is 0.46x SDPA at 128 tokens, even at 256 (1.03x), faster from 512 (README, Performance).
    threshold: int = 256
    seed: int = 0

    def validate(self) -> "LatteConfig":
        """Checks every field; raises ``ValueError`` naming the bad one."""
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown LATTE variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown selection {self.selection!r}; choose one of {', '.join(SELECTIONS)}")
        if self.mode not in ("linear", "dynamic"):
            raise ValueError(f"mode of the selected layers must be 'linear' or 'dynamic', got {self.mode!r}")
        if self.num_linear is None:
            num_linear_layers(1, ratio=self.ratio)  # validates the ratio
        if not 0.0 <= float(self.holdout) < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if isinstance(self.refit_reg, (int, float)):
            self.refit_reg = (float(self.refit_reg),)
        if not self.refit_reg or any(float(r) < 0 for r in self.refit_reg):
            raise ValueError(f"refit_reg must be non-empty and >= 0, got {self.refit_reg}")
        if int(self.num_images) < 1:
            raise ValueError(f"num_images must be >= 1, got {self.num_images}")
        if isinstance(self.candidates, str):
            self.candidates = (self.candidates,)
        if not self.candidates:
            raise ValueError("candidates is empty: name the attention modules to linearize by pattern")
        return self

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "LatteConfig":
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown LATTE setting(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d).validate()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["candidates"] = list(d["candidates"])
        d["refit_reg"] = [float(r) for r in d["refit_reg"]]
        return d


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


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


def _output_sq_error(a: Any, b: Any) -> tuple[float, int]:
    ta, tb = _tensors(a), _tensors(b)
    err = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(ta, tb) if x.is_floating_point())
    return err, sum(x.numel() for x in ta if x.is_floating_point())


def _passthrough(it: Iterable, total: int, desc: str) -> Iterable:
    return it


def attention_gflops(
    shapes: dict[str, tuple[int, int]], layers: dict[str, LatteParams], linear: Iterable[str], mode: str = "linear"
) -> float:
    """Attention-core GFLOPs of one image, given each layer's ``(N, M)``: ``linear`` layers in ``mode``, the rest exact."""
    linear = set(linear)
    total = 0
    for name, (n, m) in shapes.items():
        lay = layers[name]
        total += flops_mod.mode_flops(n, m, lay.embed_dim, lay.num_heads, mode if name in linear else "exact")
    return total / 1e9


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    batches: Sequence[Any],
    forward: Callable[[Any], Any],
    cfg: LatteConfig,
    all_reduce: Optional[AllReduce] = None,
    log: Callable[[str], None] = print,
    progress: Callable[[Iterable, int, str], Iterable] = _passthrough,
    shard: tuple[int, int] = (0, 1),
    positions: Optional[Sequence[int]] = None,
) -> dict:
    """Records, fits, scores and selects; leaves ``model`` hybrid and returns the report.

    Args:
        model: a model whose candidate attention modules hold :class:`LatteParams`.
        batches: calibration batches (this rank's share), reused for every pass.
        forward: runs the model on one batch; returns its raw outputs (tensors, nested ok).
        cfg: the settings.
        all_reduce: sums a float64 tensor across ranks in place; identity when None.
        log: receives progress lines.
        progress: wraps an iterable in a progress bar.
        shard: ``(rank, world_size)``. Batches are assumed dealt to ranks round-robin (as
            mmengine's ``DefaultSampler`` and detectron2's samplers do), so local batch ``i`` is
            global batch ``i * world_size + rank``; the held-out split is made on global
            positions and is the same whatever the number of processes.
        positions: the global position of each local batch, for loaders that shard otherwise
            (e.g. detectron2's ``InferenceSampler`` gives each rank a contiguous block).

    Returns:
        ``{variant, candidates, sensitivity, linearized, params, fit, selection, attention_gflops, config}``.
    """
    cfg.validate()
    reduce = all_reduce or (lambda t: t)
    layers = find_latte_layers(model)
    if not layers:
        raise ValueError("the model has no LATTE layers: swap the candidate attention modules in first")
    count = torch.tensor([float(len(batches))], dtype=torch.float64)
    if float(reduce(count)[0]) == 0:
        raise ValueError("empty calibration set: the calibration loader gave no batch; give num_images >= 1")
    k = num_linear_layers(len(layers), cfg.ratio, cfg.num_linear)
    was_training = model.training
    model.eval()
    names = list(layers)
    for layer in layers.values():
        layer.variant = cfg.variant
        layer.mode = "exact"

    # held-out batches: never fitted on or selected on; the knobs are chosen on them
    batches = list(batches)
    rank, world = shard
    period = max(2, int(round(1.0 / float(cfg.holdout)))) if cfg.holdout > 0 else 0
    if positions is None:
        positions = [i * world + rank for i in range(len(batches))]
    is_held = [period > 0 and int(g) % period == period - 1 for g in list(positions)[: len(batches)]]
    fit_batches = [b for b, h in zip(batches, is_held) if not h]
    held_batches = [b for b, h in zip(batches, is_held) if h]

    def record(group: list[str], desc: str) -> tuple[dict, dict]:
        recs = {n: LayerRecorder(n, cfg.max_items, cfg.max_queries, cfg.seed) for n in group}
        held = {n: LayerRecorder(n, cfg.max_items, cfg.max_queries, cfg.seed + 1) for n in group}
        try:
            for part, rec in ((fit_batches, recs), (held_batches, held)):
                for n in group:
                    layers[n].recorder = rec[n]
                for batch in progress(part, len(part), desc if rec is recs else desc + " (held-out)"):
                    forward(batch)
        finally:
            for n in group:
                layers[n].recorder = None
        return recs, held

    # 1-2. record and fit
    n_held_global = float(reduce(torch.tensor([float(len(held_batches))], dtype=torch.float64))[0])
    refit_regs = tuple(float(r) for r in cfg.refit_reg)
    if cfg.refit and n_held_global == 0 and len(refit_regs) > 1:
        log(f"[latte] no held-out images to choose the refit strength: using {REFIT_FALLBACK}")
        refit_regs = (REFIT_FALLBACK,)
    fits = {}
    groups = [[n] for n in names] if cfg.sequential else [names]
    for group in groups:
        recs, held = record(group, f"recording {group[0]}" if cfg.sequential else "recording")
        for n in group:
            res = fit_layer(layers[n], recs[n].items, cfg.steps, cfg.lr, cfg.fit_sigma, reduce, cfg.per_head,
                            heldout=held[n].items, refit=cfg.refit, refit_regs=refit_regs)
            fits[n] = {"mse_initial": res.initial_mse, "mse_final": res.final_mse, "alpha_init": res.alpha_init,
                       "heldout_mse": res.heldout_mse, "steps": res.steps, "refit_reg": res.refit_reg,
                       "heldout": res.heldout}
            held_txt = "" if res.heldout_mse is None else f", held-out {res.heldout_mse:.3e} (steps {res.steps})"
            log(f"[latte] fitted {n}: alpha={layers[n].alpha:.4f} rho={float(layers[n].log_rho.exp().mean()):.4g} "
                f"mse {res.initial_mse:.3e} -> {res.final_mse:.3e}{held_txt}")
            if cfg.sequential:
                layers[n].mode = "linear"

    # 3. sensitivity: exact vs fully linear activations, streamed
    stats = {n: SensitivityStats() for n in names}
    shapes: dict[str, list[float]] = {n: [0.0, 0.0, 0.0] for n in names}
    captured: dict[str, Tensor] = {}

    def make_probe(n: str):
        def probe(o: Tensor) -> None:
            captured[n] = o.detach()
        return probe

    for n in names:
        layers[n].probe = make_probe(n)
    try:
        for batch in progress(fit_batches, len(fit_batches), "scoring"):
            set_modes(layers, [])
            captured.clear()
            forward(batch)
            exact = dict(captured)
            set_modes(layers, names)
            captured.clear()
            forward(batch)
            for n in names:
                if n not in exact or n not in captured:
                    raise RuntimeError(f"layer {n} was not run by forward(); is it really used by the model?")
                stats[n].update(exact[n], captured[n])
                b, nq, _ = exact[n].shape
                shapes[n][0] += nq * b
                shapes[n][2] += b
    finally:
        for n in names:
            layers[n].probe = None
    sens = {}
    for n in names:
        stats[n].sums = reduce(stats[n].sums)
        sens[n] = stats[n].score(cfg.lam)
    # (N, M) per layer: self-attention here, so M = N; averaged over images.
    tok = torch.tensor([[shapes[n][0], shapes[n][2]] for n in names], dtype=torch.float64)
    tok = reduce(tok)
    mean_shapes = {n: (int(round(float(tok[i, 0] / tok[i, 1]))),) * 2 for i, n in enumerate(names)}

    # 4. select
    trace: list[dict] = []

    def distortion_on(sub: list) -> Callable[[list[str]], float]:
        set_modes(layers, [])
        ref = [forward(b) for b in sub]

        def distortion(linear: list[str]) -> float:
            set_modes(layers, linear)
            acc = torch.zeros(2, dtype=torch.float64)
            for b, r in zip(sub, ref):
                e, c = _output_sq_error(forward(b), r)
                acc[0] += e
                acc[1] += c
            acc = reduce(acc)
            return float(acc[0] / acc[1]) if float(acc[1]) > 0 else float("nan")

        return distortion

    if cfg.selection == "score":
        chosen = select_by_score(sens, k)
    else:
        select = greedy_select if cfg.selection == "greedy" else backward_select
        chosen, trace = select(names, k, distortion_on(list(fit_batches[: max(1, cfg.greedy_images)])))
    heldout_distortion = None
    if n_held_global > 0:
        heldout_distortion = distortion_on(held_batches)(list(chosen))
    chosen = [n for n in names if n in chosen]
    set_modes(layers, chosen, cfg.mode)
    for layer in layers.values():
        layer.threshold.fill_(int(cfg.threshold))
    model.train(was_training)
    for n in names:
        log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")
    return {
        "variant": cfg.variant,
        "candidates": names,
        "sensitivity": sens,
        "linearized": chosen,
        "params": {n: layers[n].scalars() for n in names},
        "sigma_mean": {n: float(layers[n].sigma.mean()) for n in names},
        "fit": fits,
        "selection": {"method": cfg.selection, "k": k, "trace": trace, "heldout_distortion": heldout_distortion,
                      "fit_batches": len(fit_batches), "heldout_batches": len(held_batches)},
        "tokens": {n: mean_shapes[n][0] for n in names},
        "attention_gflops": {
            "exact": attention_gflops(mean_shapes, layers, []),
            "linearized": attention_gflops(mean_shapes, layers, chosen),
        },
        "config": cfg.to_dict(),
    }
