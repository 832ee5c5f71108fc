"""The whole training-free flow on any model whose candidate layers carry :class:`LatteParams`.

Steps (``../shared/ARCHITECTURE.md``): record -> fit -> score -> select. A framework adapter
supplies the model (already swapped), a list of calibration batches, a ``forward``
callable that runs one batch, and an ``all_reduce`` for distributed runs; it decides
*when* to call :func:`calibrate_model`.
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import flops as flops_mod
from .calibration import (CORRECTIONS, REFIT_FALLBACK, REFIT_REGS, AllReduce, LayerRecorder, _no_reduce, fit_layer,
                          share_items)
from .kernels import VARIANTS
from .layer import LatteParams
from .selection import SensitivityStats, backward_select, greedy_select, num_linear_layers, select_by_score

__all__ = [
    "LatteConfig",
    "find_latte_layers",
    "match_candidates",
    "set_modes",
    "calibrate_model",
    "attention_gflops",
    "needs_calibration",
    "CALIBRATE",
]

#: Layer selections; ``auto`` picks, per model, whichever of the others distorts the model's
#: outputs least on the choice images.
SELECTIONS = ("score", "greedy", "backward", "auto")
#: When a model calibrates: ``auto`` only if its LATTE layers hold no calibrated state,
#: ``always`` even if they do, ``never`` (an uncalibrated model is then an error).
CALIBRATE = ("auto", "always", "never")


@dataclass
class LatteConfig:
    """Everything a user sets for LATTE; the same keys in every adapter (mmdet ``LinearizeHook``,
    detectron2 ``model.latte`` and ``LinearizeHook``, :func:`latte_plugin.linearize`) and, as
    ``--flags``, in ``tools/calibrate.py`` (built from this docstring).

    Attributes:
        candidates: fnmatch patterns over module names of the attention modules that may go linear.
        ratio: fraction of the candidates made linear (ignored when num_linear is set).
        num_linear: exact number of candidates made linear.
        variant: feature map: qtvit, jpn_only, tte_only or latte.
        num_images: calibration images taken from the train split.
        max_items: images recorded per layer, across all ranks (lowest keyed priority kept).
        max_queries: query tokens recorded per image (keyed random subset).
        steps: maximum L-BFGS iterations of the per-layer fit (with held-out images the count is chosen on them).
        lr: L-BFGS step scale.
        correction: output correction of each linear layer: none, sigma (the paper), refit (ridge refit of the whole output, beyond the paper), or auto (per layer, the candidate with the lowest cross-fitted error).
        refit_reg: candidate ridge strengths of the refit, relative to the input energy (chosen on held-out images).
        holdout: fraction of calibration images held out; half of them choose the knobs, the other half only report held-out errors; 0 disables.
        per_head: fit one (alpha, rho) per head instead of one per layer (beyond the paper).
        sequential: fit layer l on inputs from the model with the layers before it already linear.
        selection: greedy (add the layer that hurts the final output least), backward (start all-linear, restore the most harmful), score (the paper's per-layer score), or auto (per model, the one of these with the lowest output distortion on the choice images).
        target: accuracy budget instead of a count: the largest number of layers (in greedy order) whose relative output distortion on the choice images stays within it, e.g. 0.01 (ratio and num_linear are then ignored).
        lam: lambda of the sensitivity score.
        greedy_images: calibration images the global selections compare outputs on.
        mode: mode of the selected layers: linear, or dynamic (softmax below threshold keys).
        threshold: key count below which dynamic layers use softmax (the measured CPU crossover; re-measure on your hardware).
        seed: seeds the calibration sampler and the recorders' keyed sampling.
        calibrate: auto (only if the model holds no LATTE state), always, or never (an uncalibrated model is an error).
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
    correction: str = "auto"
    refit_reg: Sequence[float] = REFIT_REGS
    holdout: float = 0.25
    per_head: bool = False
    sequential: bool = False
    selection: str = "auto"
    target: Optional[float] = None
    lam: float = 10.0
    greedy_images: int = 8
    mode: str = "linear"
    # Crossover measured by benchmarks/attention.py on 2 idle CPU cores (fp32, 8 heads of 32):
    # LATTE is 0.46x SDPA at 128 tokens, even at 256 (1.03x), faster from 512 (README, Performance).
    threshold: int = 256
    seed: int = 0
    calibrate: str = "auto"

    def validate(self) -> "LatteConfig":
        """Checks every field; raises ``ValueError`` naming the bad one."""
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown LATTE variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown selection {self.selection!r}; choose one of {', '.join(SELECTIONS)}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown output correction {self.correction!r}; choose one of {', '.join(CORRECTIONS)}")
        if self.target is not None and not float(self.target) > 0:
            raise ValueError(f"target (a relative output distortion) must be > 0, got {self.target}")
        if self.calibrate not in CALIBRATE:
            raise ValueError(f"calibrate must be one of {', '.join(CALIBRATE)}, got {self.calibrate!r}")
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
        if unknown & {"refit", "fit_sigma"}:
            raise ValueError("'refit' and 'fit_sigma' were replaced by correction='none'|'sigma'|'refit'")
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


#: The roles of calibration images: fitted on; choosing the knobs; only reporting held-out errors.
ROLES = ("fit", "choose", "report")


@dataclass
class CalibrationSplit:
    """This rank's calibration batches by role, each as ``(global position, batch)``.

    The roles come from the global position alone (:func:`image_role`), so the split is the
    same whatever the number of processes. ``greedy`` is the global selections' subset of ``fit``.
    """

    fit: list = field(default_factory=list)
    choose: list = field(default_factory=list)
    report: list = field(default_factory=list)
    greedy: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def image_role(position: int, holdout: float) -> str:
    """``fit``, ``choose`` or ``report`` for a global batch position.

    Every ``round(1 / holdout)``-th position is held out; held-out positions alternate between
    ``choose`` (they pick the knobs) and ``report`` (nothing is fitted on or chosen by them).
    """
    if holdout <= 0:
        return "fit"
    period = max(2, int(round(1.0 / float(holdout))))
    if position % period != period - 1:
        return "fit"
    return "choose" if (position // period) % 2 == 0 else "report"


def split_calibration(batches: Sequence[Any], positions: Sequence[int], cfg: LatteConfig,
                      reduce: AllReduce) -> CalibrationSplit:
    """Deals this rank's batches to the roles and picks the global greedy subset of ``fit``:
    the ``greedy_images`` fit positions of lowest global position (whichever rank holds them)."""
    split = CalibrationSplit()
    for pos, batch in zip(positions, batches):
        getattr(split, image_role(int(pos), cfg.holdout)).append((int(pos), batch))
    fit_rank = {}  # global position -> index among the global fit positions (a function of the position)
    for g in range(max((int(p) for p in positions), default=-1) + 1):
        if image_role(g, cfg.holdout) == "fit":
            fit_rank[g] = len(fit_rank)
    split.greedy = [(p, b) for p, b in split.fit if fit_rank[p] < max(1, cfg.greedy_images)]
    local = torch.tensor([float(len(getattr(split, r))) for r in ROLES], dtype=torch.float64)
    split.counts = dict(zip(ROLES, (int(x) for x in reduce(local).tolist())))
    return split


def record_layers(layers: dict[str, LatteParams], group: list[str], split: CalibrationSplit, cfg: LatteConfig,
                  forward: Callable[[Any], Any], progress: Callable, reduce: AllReduce,
                  shard: tuple[int, int], desc: str) -> dict[str, dict[str, LayerRecorder]]:
    """Runs every role's batches once with recorders on ``group``: ``{role: {layer: recorder}}``.

    Each image is keyed by its global position, so sampling and the ``max_items`` budget
    (applied across ranks) do not depend on the number of processes.
    """
    recs = {role: {n: LayerRecorder(n, cfg.max_items, cfg.max_queries, cfg.seed) for n in group} for role in ROLES}
    try:
        for role in ROLES:
            part = getattr(split, role)
            for n in group:
                layers[n].recorder = recs[role][n]
            label = desc if role == "fit" else f"{desc} ({role} images)"
            for pos, batch in progress(part, len(part), label):
                for n in group:
                    recs[role][n].batch_key = pos
                forward(batch)
    finally:
        for n in group:
            layers[n].recorder = None
    for role in ROLES:
        for rec in recs[role].values():
            share_items(rec, reduce, shard)
    return recs


def _refit_regs(cfg: LatteConfig, split: CalibrationSplit, log: Callable[[str], None]) -> tuple:
    regs = tuple(float(r) for r in cfg.refit_reg)
    if cfg.correction == "refit" and split.counts["choose"] == 0 and len(regs) > 1:
        log(f"[latte] no held-out images to choose the refit strength: using {REFIT_FALLBACK}")
        return (REFIT_FALLBACK,)
    return regs


def fit_layers(layers: dict[str, LatteParams], group: list[str], recs: dict, cfg: LatteConfig,
               refit_regs: tuple, log: Callable[[str], None]) -> dict[str, dict]:
    """Fits each layer of ``group`` on its ``fit`` records (knobs on ``choose``, errors on ``report``)."""
    fits = {}
    for n in group:
        # every rank holds every item (share_items): no all-reduce, so the sums run in one fixed order
        res = fit_layer(layers[n], recs["fit"][n].items, cfg.steps, cfg.lr, cfg.correction, _no_reduce, cfg.per_head,
                        choose=recs["choose"][n].items, report=recs["report"][n].items, refit_regs=refit_regs)
        fits[n] = {"mse_initial": res.initial_mse, "mse_final": res.final_mse, "alpha_init": res.alpha_init,
                   "heldout_mse": res.heldout_mse, "steps": res.steps, "refit_reg": res.refit_reg,
                   "heldout": res.heldout, "choice": res.choice, "correction": res.correction}
        held = "" if res.heldout_mse is None else f", held-out {res.heldout_mse:.3e}"
        log(f"[latte] fitted {n}: alpha={layers[n].alpha:.4f} rho={float(layers[n].log_rho.exp().mean()):.4g} "
            f"mse {res.initial_mse:.3e} -> {res.final_mse:.3e}{held} (steps {res.steps}, {res.correction})")
    return fits


class _Capture:
    """A layer probe that keeps the last output it saw."""

    def __init__(self, store: dict, name: str) -> None:
        self.store, self.name = store, name

    def __call__(self, out: Tensor) -> None:
        self.store[self.name] = out.detach()


def score_sensitivity(layers: dict[str, LatteParams], batches: list, forward: Callable[[Any], Any],
                      cfg: LatteConfig, reduce: AllReduce, progress: Callable) -> tuple[dict, dict]:
    """The paper's per-layer score (exact vs fully linear outputs, streamed) and each layer's
    mean token count ``{layer: (N, N)}``, over ``batches``."""
    names = list(layers)
    stats = {n: SensitivityStats() for n in names}
    tokens = torch.zeros(len(names), 2, dtype=torch.float64)  # (token rows, images) per layer
    captured: dict[str, Tensor] = {}
    for n in names:
        layers[n].probe = _Capture(captured, n)
    try:
        for _, batch in progress(batches, len(batches), "scoring"):
            outs = []
            for linear in ([], names):
                set_modes(layers, linear)
                captured.clear()
                forward(batch)
                outs.append(dict(captured))
            for i, n in enumerate(names):
                if n not in outs[0] or n not in outs[1]:
                    raise RuntimeError(f"layer {n} was not run by forward(); is it really used by the model?")
                stats[n].update(outs[0][n], outs[1][n])
                tokens[i] += torch.tensor([outs[0][n].shape[0] * outs[0][n].shape[1], outs[0][n].shape[0]])
    finally:
        for n in names:
            layers[n].probe = None
    for n in names:
        stats[n].sums = reduce(stats[n].sums)
    tokens = reduce(tokens)
    shapes = {n: (int(round(float(tokens[i, 0] / tokens[i, 1]))),) * 2 for i, n in enumerate(names)}
    return {n: stats[n].score(cfg.lam) for n in names}, shapes


def output_distortion(layers: dict[str, LatteParams], batches: list, forward: Callable[[Any], Any],
                      reduce: AllReduce, relative: bool = False) -> Callable[[list[str]], float]:
    """``linear layers -> mean squared change of the model's raw outputs`` on ``batches`` (global);
    with ``relative``, divided by the mean square of the exact outputs."""
    set_modes(layers, [])
    ref = [forward(b) for _, b in batches]
    energy = reduce(torch.tensor([sum(_energy(r) for r in ref)], dtype=torch.float64))

    def distortion(linear: list[str]) -> float:
        set_modes(layers, linear)
        acc = torch.zeros(2, dtype=torch.float64)
        for (_, b), r in zip(batches, ref):
            e, c = _output_sq_error(forward(b), r)
            acc += torch.tensor([e, float(c)], dtype=torch.float64)
        acc = reduce(acc)
        if float(acc[1]) == 0:
            return float("nan")
        return float(acc[0] / energy[0]) if relative else float(acc[0] / acc[1])

    return distortion


def _energy(out: Any) -> float:
    """Sum of squares of a model output's floating-point tensors."""
    return sum(float((t.double() ** 2).sum()) for t in _tensors(out) if t.is_floating_point())


def _select(method: str, layers: dict[str, LatteParams], sens: dict[str, float], k: int,
            distortion: Callable[[list[str]], float]) -> tuple[list, list]:
    if method == "score":
        return select_by_score(sens, k), []
    return (greedy_select if method == "greedy" else backward_select)(list(layers), k, distortion)


def _held_images(split: CalibrationSplit) -> list:
    """The images that choose among selections: the choice images, else the greedy subset."""
    return split.choose if split.counts.get("choose") else split.greedy


def select_layers(layers: dict[str, LatteParams], sens: dict[str, float], k: int, cfg: LatteConfig,
                  split: CalibrationSplit, forward: Callable[[Any], Any], reduce: AllReduce) -> tuple[list, list, dict]:
    """The ``k`` layers to linearize (model order), the selection's trace, and with
    ``selection='auto'`` each method's output distortion on the choice images."""
    fit_distortion = output_distortion(layers, split.greedy, forward, reduce)
    if cfg.selection != "auto":
        chosen, trace = _select(cfg.selection, layers, sens, k, fit_distortion)
        return [n for n in layers if n in chosen], trace, {}
    held = output_distortion(layers, _held_images(split), forward, reduce)
    runs = {m: _select(m, layers, sens, k, fit_distortion) for m in ("score", "greedy", "backward")}
    errs = {m: held(list(chosen)) for m, (chosen, _) in runs.items()}
    order = ["score", "greedy", "backward"]  # the paper's score wins ties
    best = min(order, key=lambda m: (errs[m], order.index(m)))
    chosen, trace = runs[best]
    return [n for n in layers if n in chosen], trace, {"chosen": best, "choice_distortion": errs}


def count_for_target(layers: dict[str, LatteParams], sens: dict[str, float], cfg: LatteConfig,
                     split: CalibrationSplit, forward: Callable[[Any], Any], reduce: AllReduce) -> tuple[int, dict]:
    """With ``target``: the largest prefix of the greedy order whose relative output distortion
    on the choice images stays within it; returns the count and the distortion of each prefix."""
    order, _ = greedy_select(list(layers), len(layers), output_distortion(layers, split.greedy, forward, reduce))
    rel = output_distortion(layers, _held_images(split), forward, reduce, relative=True)
    prefix = {j: rel(order[:j]) for j in range(1, len(order) + 1)}
    k = max([0] + [j for j, e in prefix.items() if e <= float(cfg.target)])
    return k, {"target": float(cfg.target), "order": order, "relative_distortion": prefix, "k": k}


def build_report(layers: dict[str, LatteParams], cfg: LatteConfig, k: int, chosen: list[str], sens: dict,
                 fits: dict, trace: list, split: CalibrationSplit, shapes: dict,
                 heldout_distortion: Optional[float]) -> dict:
    """The calibration report (the keys of spec section 10 plus our fit and selection details)."""
    names = list(layers)
    return {
        "variant": cfg.variant,
        "candidates": names,
        "sensitivity": sens,
        "linearized": chosen,
        "params": {n: layers[n].scalars() for n in names},
        "sigma_mean": {n: float(layers[n].sigma.mean()) for n in names},
        "fit": fits,
        "selection": {"method": cfg.selection, "k": k, "trace": trace, "heldout_distortion": heldout_distortion,
                      "images": dict(split.counts), "greedy_images": len(split.greedy)},
        "tokens": {n: shapes[n][0] for n in names},
        "attention_gflops": {"exact": attention_gflops(shapes, layers, []),
                             "linearized": attention_gflops(shapes, layers, chosen)},
        "config": cfg.to_dict(),
    }


def _prepare(model: nn.Module, cfg: LatteConfig, batches: Sequence[Any], reduce: AllReduce) -> dict[str, LatteParams]:
    cfg.validate()
    layers = find_latte_layers(model)
    if not layers:
        raise ValueError("the model has no LATTE layers: swap the candidate attention modules in first")
    if float(reduce(torch.tensor([float(len(batches))], dtype=torch.float64))[0]) == 0:
        raise ValueError("empty calibration set: the calibration loader gave no batch; give num_images >= 1")
    for layer in layers.values():
        layer.variant = cfg.variant
        layer.mode = "exact"
    return layers


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
    """Splits, records, fits, scores, selects and reports; leaves ``model`` hybrid.

    Args:
        model: a model whose candidate attention modules hold :class:`LatteParams`.
        batches: calibration batches (this rank's share), reused for every pass.
        forward: runs the model on one batch; returns its raw outputs (tensors, nested ok).
        cfg: the settings.
        all_reduce: sums a float64 tensor across ranks in place; identity when None.
        log: receives progress lines.
        progress: wraps an iterable in a progress bar: ``progress(iterable, total, description)``.
        shard: ``(rank, world_size)``. Batches are assumed dealt to ranks round-robin (as
            mmengine's ``DefaultSampler`` and detectron2's ``TrainingSampler`` do), so local batch
            ``i`` is global batch ``i * world_size + rank``.
        positions: the global position of each local batch, for loaders that shard otherwise
            (e.g. detectron2's ``InferenceSampler`` gives each rank a contiguous block).

    Returns:
        ``{variant, candidates, sensitivity, linearized, params, fit, selection, attention_gflops, config, ...}``.
    """
    reduce = all_reduce or (lambda t: t)
    layers = _prepare(model, cfg, batches, reduce)
    was_training = model.training
    model.eval()
    rank, world = shard
    positions = list(positions) if positions is not None else [i * world + rank for i in range(len(batches))]
    split = split_calibration(list(batches), positions[: len(batches)], cfg, reduce)
    regs = _refit_regs(cfg, split, log)
    fits: dict[str, dict] = {}
    for group in ([[n] for n in layers] if cfg.sequential else [list(layers)]):
        recs = record_layers(layers, group, split, cfg, forward, progress, reduce, shard,
                             f"recording {group[0]}" if cfg.sequential else "recording")
        fits.update(fit_layers(layers, group, recs, cfg, regs, log))
        if cfg.sequential:
            layers[group[0]].mode = "linear"
    sens, shapes = score_sensitivity(layers, split.fit, forward, cfg, reduce, progress)
    budget = count_for_target(layers, sens, cfg, split, forward, reduce) if cfg.target is not None else None
    k = budget[0] if budget else num_linear_layers(len(layers), cfg.ratio, cfg.num_linear)
    chosen, trace, auto = select_layers(layers, sens, k, cfg, split, forward, reduce)
    held = output_distortion(layers, split.report, forward, reduce)(chosen) if split.counts["report"] else None
    auto = dict(auto, **({"target": budget[1]} if budget else {}))
    set_modes(layers, chosen, cfg.mode)
    for layer in layers.values():
        layer.threshold.fill_(int(cfg.threshold))
    model.train(was_training)
    for n in layers:
        log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")
    report = build_report(layers, cfg, k, chosen, sens, fits, trace, split, shapes, held)
    report["selection"].update(auto)
    return report


def needs_calibration(model: nn.Module, calibrate: str) -> bool:
    """Whether a model with LATTE layers should calibrate now, under ``calibrate`` (:data:`CALIBRATE`).

    Raises:
        ValueError: the layers are partly calibrated (a checkpoint made for other candidates),
            or ``calibrate='never'`` and they are not calibrated.
    """
    if calibrate not in CALIBRATE:
        raise ValueError(f"calibrate must be one of {', '.join(CALIBRATE)}, got {calibrate!r}")
    flags = [bool(layer.calibrated) for layer in find_latte_layers(model).values()]
    if flags and any(flags) and not all(flags):
        raise ValueError("the checkpoint holds LATTE state for some candidate layers but not others: it was "
                         "calibrated with other candidates; re-run tools/calibrate.py for this config")
    calibrated = bool(flags) and all(flags)
    if calibrate == "never" and not calibrated:
        raise ValueError("calibrate='never' but the model holds no calibrated LATTE state: load a checkpoint "
                         "written by tools/calibrate.py, or set calibrate='auto'")
    return calibrate == "always" or not calibrated
