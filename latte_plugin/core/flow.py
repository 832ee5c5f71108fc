"""The whole training-free flow on any model whose candidate layers carry :class:`LatteParams`.

Steps (``../shared/ARCHITECTURE.md``): record -> fit -> score -> select. A framework adapter
supplies the model (already swapped), a list of calibration batches, a ``forward``
callable that runs one batch, and an ``all_reduce`` for distributed runs; it decides
*when* to call :func:`calibrate_model`.
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import flops as flops_mod
from .calibration import (CORRECTIONS, CROSS_FIT_FOLDS, REFIT_FALLBACK, REFIT_REGS, AllReduce, FitResult,
                          LayerRecorder, _no_reduce, assign_folds, fit_correction, fit_layer, set_correction,
                          share_items)
from .fidelity import RawDistortion
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
    "apply_inference_settings",
    "CALIBRATE",
]

#: Layer selections; ``auto`` picks, per model, whichever of the others distorts the model's
#: outputs least on the choice images.
SELECTIONS = ("score", "greedy", "backward", "auto")
#: When a model calibrates: ``auto`` only if its LATTE layers hold no calibrated state,
#: ``always`` even if they do, ``never`` (an uncalibrated model is then an error).
CALIBRATE = ("auto", "always", "never")
#: Error compensation after the selection: ``auto`` keeps it only where it lowers the
#: cross-fitted output error.
COMPENSATE = ("auto", "always", "never")
#: Modes of the selected layers at inference.
INFERENCE_MODES = ("linear", "dynamic")


def _opt(default: Any, help: str, choices: Optional[Sequence[str]] = None) -> Any:
    """A ``LatteConfig`` field with its help text (and choices) as metadata: the one place that
    ``tools/calibrate.py``'s flags, ``--help`` and the docs read them from."""
    meta = {"help": help, **({"choices": tuple(choices)} if choices else {})}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LatteConfig:
    """Everything a user sets for LATTE; the same keys in every adapter (mmdet ``LinearizeHook``,
    detectron2 ``model.latte`` and ``LinearizeHook``, :func:`latte_plugin.linearize`) and, as
    ``--flags``, in ``tools/calibrate.py``.

    Each field's meaning is its ``metadata["help"]`` (and ``metadata["choices"]`` where the
    values are a closed set); :meth:`field_help` lists them.
    """

    candidates: Sequence[str] = _opt(("encoder.layers.*.self_attn",),
                                     "fnmatch patterns over module names of the attention modules that may go linear")
    ratio: Optional[float] = _opt(0.67, "fraction of the candidates made linear, in (0, 1] (ignored when "
                                        "num_linear is set)")
    num_linear: Optional[int] = _opt(None, "exact number of candidates made linear")
    variant: str = _opt("latte", "feature map", VARIANTS)
    num_images: int = _opt(64, "calibration images taken from the train split (the first num_images of the "
                               "sampler's order, whatever the number of processes)")
    max_items: int = _opt(64, "images recorded per layer, across all ranks (lowest keyed priority kept); >= 1")
    max_queries: int = _opt(128, "query tokens recorded per image (keyed random subset)")
    steps: int = _opt(20, "maximum L-BFGS iterations of the per-layer fit (with held-out images the count "
                          "is chosen on them)")
    lr: float = _opt(1.0, "L-BFGS step scale")
    correction: str = _opt("auto", "output correction of each linear layer: none, sigma (the paper), refit "
                                   "(ridge refit of the whole output), or auto (per layer, the candidate with the "
                                   "lowest cross-fitted error)", CORRECTIONS)
    refit_reg: Sequence[float] = _opt(REFIT_REGS, "candidate ridge strengths of the refit, relative to the input "
                                                  "energy (chosen on held-out images)")
    holdout: float = _opt(0.25, "fraction of calibration images held out, in [0, 1): half of them choose the "
                                "knobs, the other half only report held-out errors; 0 disables")
    per_head: bool = _opt(False, "fit one (alpha, rho) per head instead of one per layer")
    sequential: bool = _opt(False, "fit layer l on inputs from the model with the layers before it already linear")
    compensate: str = _opt("auto", "error compensation after the selection: refit each linear layer's output "
                                   "correction on inputs from the hybrid against the exact model's outputs; auto "
                                   "keeps it only if its cross-fitted output error is lower", COMPENSATE)
    selection: str = _opt("auto", "greedy (add the layer that hurts the final output least), backward (start "
                                  "all-linear, restore the most harmful), score (the paper's per-layer score), or "
                                  "auto (the one of these with the lowest cross-fitted output error)",
                          SELECTIONS)
    target: Optional[float] = _opt(None, "fidelity budget in (0, 1) instead of a count: the most layers whose "
                                         "cross-fitted fidelity loss stays within it; for detectors 1 - agreement "
                                         "of the detections with the exact model's (0.05 keeps 95 percent), else the "
                                         "relative raw-output distortion (ratio and num_linear are then ignored)")
    lam: float = _opt(10.0, "lambda of the sensitivity score")
    greedy_images: int = _opt(8, "calibration images the global selections compare outputs on")
    mode: str = _opt("linear", "mode of the selected layers at inference: linear, or dynamic (softmax below "
                               "threshold keys); applies to a loaded calibration too", INFERENCE_MODES)
    # Crossover measured by benchmarks/attention.py on 2 idle CPU cores (fp32, 8 heads of 32):
    # LATTE is 0.46x SDPA at 128 tokens, even at 256 (1.03x), faster from 512 (README, Performance).
    threshold: int = _opt(256, "key count below which dynamic layers use softmax (the measured CPU crossover; "
                               "re-measure on your hardware); applies to a loaded calibration too")
    seed: int = _opt(0, "seeds the calibration sampler and the recorders' keyed sampling")
    calibrate: str = _opt("auto", "auto (only if the model holds no LATTE state), always, or never (an "
                                  "uncalibrated model is an error)", CALIBRATE)

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """``{field: help}`` of every field."""
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}

    def validate(self) -> "LatteConfig":
        """Checks every field; raises ``ValueError`` naming the bad one."""
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown LATTE variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown selection {self.selection!r}; choose one of {', '.join(SELECTIONS)}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown output correction {self.correction!r}; choose one of {', '.join(CORRECTIONS)}")
        if self.target is not None and not 0.0 < float(self.target) < 1.0:
            raise ValueError(f"target (a fidelity loss budget, e.g. 0.05 keeps 95%) must be in (0, 1), got {self.target}")
        if self.compensate not in COMPENSATE:
            raise ValueError(f"compensate must be one of {', '.join(COMPENSATE)}, got {self.compensate!r}")
        if self.calibrate not in CALIBRATE:
            raise ValueError(f"calibrate must be one of {', '.join(CALIBRATE)}, got {self.calibrate!r}")
        if self.mode not in INFERENCE_MODES:
            raise ValueError(f"mode of the selected layers must be 'linear' or 'dynamic', got {self.mode!r}")
        if self.num_linear is None:
            num_linear_layers(1, ratio=self.ratio)  # validates the ratio
        if not 0.0 <= float(self.holdout) < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if isinstance(self.refit_reg, (int, float)):
            self.refit_reg = (float(self.refit_reg),)
        if not self.refit_reg or any(float(r) < 0 for r in self.refit_reg):
            raise ValueError(f"refit_reg must be non-empty and >= 0, got {self.refit_reg}")
        for name in ("num_images", "max_items", "max_queries", "greedy_images"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if int(self.steps) < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
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
               refit_regs: tuple, log: Callable[[str], None], fold_of: dict[int, int]) -> tuple[dict, dict]:
    """Fits each layer of ``group`` on its ``fit`` records (knobs on ``choose``, errors on ``report``).

    Returns:
        ``({layer: report entry}, {layer: (correction kind, weights, weights per fold)})``; the
        second feeds :func:`cross_fitted`.
    """
    fits, corrections = {}, {}
    for n in group:
        # every rank holds every item (share_items): no all-reduce, so the sums run in one fixed order
        res = fit_layer(layers[n], recs["fit"][n].items, cfg.steps, cfg.lr, cfg.correction, _no_reduce, cfg.per_head,
                        choose=recs["choose"][n].items, report=recs["report"][n].items, refit_regs=refit_regs,
                        fold_of=fold_of)
        fits[n], corrections[n] = _fit_entry(res), (res.kind, res.weights, res.fold_weights)
        held = "" if res.heldout_mse is None else f", held-out {res.heldout_mse:.3e}"
        log(f"[latte] fitted {n}: alpha={layers[n].alpha:.4f} rho={float(layers[n].log_rho.exp().mean()):.4g} "
            f"mse {res.initial_mse:.3e} -> {res.final_mse:.3e}{held} (steps {res.steps}, {res.correction})")
    return fits, corrections


def _fit_entry(res: FitResult) -> dict:
    """A layer's fit, as the report holds it."""
    return {"mse_initial": res.initial_mse, "mse_final": res.final_mse, "alpha_init": res.alpha_init,
            "heldout_mse": res.heldout_mse, "steps": res.steps, "refit_reg": res.refit_reg,
            "heldout": res.heldout, "choice": res.choice, "correction": res.correction}


def exact_targets(recs: dict) -> dict[str, dict[int, Tensor]]:
    """``{layer: {item key: exact attention output}}`` of every role's records."""
    return {n: {it.key: it.target for role in ROLES for it in recs[role][n].items} for n in recs["fit"]}


def compensate_layers(layers: dict[str, LatteParams], chosen: list[str], split: CalibrationSplit, cfg: LatteConfig,
                      forward: Callable[[Any], Any], progress: Callable, reduce: AllReduce, shard: tuple[int, int],
                      targets: dict, fold_of: dict[int, int], regs: tuple) -> tuple[dict, dict]:
    """Error compensation: in model order, each chosen layer is recorded with the chosen layers
    before it already linear (and compensated), and its output correction is refitted to map
    those inputs to the *exact* model's attention output there (kernel scalars kept).

    Returns ``({layer: report entry}, {layer: (kind, weights, weights per fold)})``.
    """
    fits, corrections = {}, {}
    set_modes(layers, [])
    for n in chosen:
        recs = record_layers(layers, [n], split, cfg, forward, progress, reduce, shard, f"compensating {n}")
        for role in ROLES:
            for it in recs[role][n].items:
                it.target = targets[n][it.key]
        res = fit_correction(layers[n], recs["fit"][n].items, cfg.correction, _no_reduce, recs["choose"][n].items,
                             recs["report"][n].items, regs, fold_of)
        fits[n], corrections[n] = _fit_entry(res), (res.kind, res.weights, res.fold_weights)
        layers[n].mode = "linear"
    return fits, corrections


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
    with ``relative``, divided by the mean square of the exact outputs. The layers keep the
    corrections they hold (fitted on the fit images)."""
    return measured(layers, batches, RawDistortion(forward, relative), reduce)


def measured(layers: dict[str, LatteParams], batches: list, measure: Any,
             reduce: AllReduce) -> Callable[[list[str]], float]:
    """``linear layers -> measure's loss`` on ``batches`` (``(position, batch)``, summed across ranks)."""
    set_modes(layers, [])
    refs = [measure.run(b) for _, b in batches]

    def loss(linear: list[str]) -> float:
        set_modes(layers, linear)
        acc = measure.zeros()
        for (_, b), r in zip(batches, refs):
            acc = acc + measure.sums(r, measure.run(b))
        return measure.loss(reduce(acc))

    return loss


def fold_assignment(split: CalibrationSplit, cfg: LatteConfig, reduce: AllReduce,
                    shard: tuple[int, int]) -> dict[int, int]:
    """``{global position: fold}`` of the fit and choice images up to the largest position of any
    rank (every rank computes the same map: ``share_items`` gives each rank the others' images)."""
    rank, world = shard
    ends = torch.zeros(world, dtype=torch.float64)  # each rank's largest position + 1 (a max through sums)
    ends[rank] = max([p + 1 for role in ROLES for p, _ in getattr(split, role)], default=0)
    n = int(max(reduce(ends).max().item(), sum(split.counts.values())))
    return assign_folds([g for g in range(n) if image_role(g, cfg.holdout) != "report"], CROSS_FIT_FOLDS)


def cross_fitted(layers: dict[str, LatteParams], corrections: dict, batches: list, fold_of: dict[int, int],
                 measure: Any, reduce: AllReduce, refs: list) -> Callable[[list[str]], float]:
    """``linear layers -> measure's loss`` on ``batches``, each image run with every linear
    layer's output correction fitted *without* that image's fold (:func:`fit_layers`), so no
    image judges a correction fitted on it. The full corrections are restored afterwards.
    ``refs``: the exact model's ``measure.run`` of each batch (:class:`CrossFitJudge` keeps them).

    The kernel scalars (two per layer) are fitted on the fit images and not cross-fitted.
    """
    folds = sorted({fold_of[p] for p, _ in batches})

    def loss(linear: list[str]) -> float:
        set_modes(layers, linear)
        acc = measure.zeros()
        try:
            for f in folds:
                for n in linear:
                    kind, _, per_fold = corrections[n]
                    set_correction(layers[n], kind, per_fold[f])
                for (p, b), r in zip(batches, refs):
                    if fold_of[p] == f:
                        acc = acc + measure.sums(r, measure.run(b))
        finally:
            for n in linear:
                kind, full, _ = corrections[n]
                set_correction(layers[n], kind, full)
        return measure.loss(reduce(acc))

    return loss


class CrossFitJudge:
    """:func:`cross_fitted` with the exact model's outputs computed once per measure and each
    set's loss under the fitted corrections remembered (the selection, the compensation and
    the target ask for some sets more than once)."""

    def __init__(self, layers: dict[str, LatteParams], corrections: dict, batches: list, fold_of: dict[int, int],
                 reduce: AllReduce) -> None:
        self.layers, self.corrections, self.batches, self.fold_of, self.reduce = (
            layers, corrections, batches, fold_of, reduce)
        self._refs: dict[str, list] = {}
        self._memo: dict[tuple, float] = {}

    def __call__(self, measure: Any, corrections: Optional[dict] = None) -> Callable[[list[str]], float]:
        """``linear layers -> cross-fitted loss``; ``corrections`` replaces the fitted ones (not remembered)."""
        if measure.name not in self._refs:
            set_modes(self.layers, [])
            self._refs[measure.name] = [measure.run(b) for _, b in self.batches]
        loss = cross_fitted(self.layers, corrections or self.corrections, self.batches, self.fold_of, measure,
                            self.reduce, self._refs[measure.name])
        if corrections is not None:
            return loss

        def remembered(linear: list[str]) -> float:
            key = (measure.name, frozenset(linear))
            if key not in self._memo:
                self._memo[key] = loss(linear)
            return self._memo[key]

        return remembered

    def forget(self) -> None:
        """Drops the remembered losses (after the fitted corrections changed)."""
        self._memo.clear()


def candidate_sets(methods: Sequence[str], layers: dict[str, LatteParams], sens: dict[str, float],
                   ks: Sequence[int], distortion: Callable[[list[str]], float]) -> tuple[dict, dict]:
    """Each method's linear set for each count in ``ks``: ``({(method, k): layers}, {method: trace})``.

    Every method is nested (the set for ``k`` holds the set for ``k - 1``), so one run per
    method gives every count: greedy adds up to ``max(ks)``, backward restores down to ``min(ks)``.
    """
    names, sets, traces = list(layers), {}, {}
    for m in methods:
        if m == "score":
            order, traces[m] = select_by_score(sens, len(names)), []
            sets.update({(m, k): order[:k] for k in ks})
        elif m == "greedy":
            order, traces[m] = greedy_select(names, max(ks), distortion)
            sets.update({(m, k): order[:k] for k in ks})
        else:
            _, traces[m] = backward_select(names, min(ks), distortion)
            restored = [t["restored"] for t in traces[m] if t["restored"] is not None]
            sets.update({(m, k): [n for n in names if n not in restored[: len(names) - k]] for k in ks})
    return {key: [n for n in names if n in chosen] for key, chosen in sets.items()}, traces


#: Selections compared by ``selection='auto'``, the paper's score first (it wins ties).
AUTO_SELECTIONS = ("score", "greedy", "backward")


def _judge_images(split: CalibrationSplit, reduce: AllReduce) -> list:
    """This rank's images that judge selections: fit and choice images the greedy and backward
    searches did not see (all fit and choice images if, across ranks, that leaves none)."""
    seen = {p for p, _ in split.greedy}
    images = sorted(split.fit + split.choose, key=lambda pb: pb[0])
    unseen = [pb for pb in images if pb[0] not in seen]
    return unseen if float(reduce(torch.tensor([float(len(unseen))], dtype=torch.float64))[0]) > 0 else images


def select_layers(layers: dict[str, LatteParams], sens: dict[str, float], k: int, cfg: LatteConfig,
                  split: CalibrationSplit, forward: Callable[[Any], Any], reduce: AllReduce,
                  judge: "CrossFitJudge", fidelity: Any) -> tuple[list, list, dict]:
    """The layers to linearize (model order), the selection's trace and how they were chosen.

    A fixed selection without a target takes its ``k`` layers. ``selection='auto'`` takes the
    method whose ``k`` layers give the lowest cross-fitted raw-output MSE (:func:`cross_fitted`
    via ``judge``). With ``target``, the count is the largest whose cross-fitted ``fidelity``
    loss, for some method, stays within the target (the lowest such loss wins).
    """
    methods = AUTO_SELECTIONS if cfg.selection == "auto" else (cfg.selection,)
    ks = list(range(1, len(layers) + 1)) if cfg.target is not None else [k]
    if not ks or max(ks) == 0:
        return [], [], {}
    sets, traces = candidate_sets(methods, layers, sens, ks, output_distortion(layers, split.greedy, forward, reduce))
    if cfg.target is not None:
        method, k, info = _within_target(methods, sets, ks, float(cfg.target), judge(fidelity), fidelity.name)
    elif len(methods) == 1:
        method, info = methods[0], {}
    else:
        mse = judge(RawDistortion(forward, relative=False))  # the same measure as the compensation's
        info = {"crossfit_distortion": {m: mse(sets[(m, k)]) for m in methods}}
        method = min(methods, key=lambda m: (info["crossfit_distortion"][m], methods.index(m)))
    chosen = sets.get((method, k), [])
    return chosen, traces.get(method, []), {"chosen": method, **info}


def _within_target(methods: Sequence[str], sets: dict, ks: Sequence[int], target: float,
                   loss: Callable[[list[str]], float], measure: str) -> tuple[str, int, dict]:
    """From the most layers down: the first count where a method's set is within ``target``
    (``loss`` remembers sets that several methods share)."""
    losses: dict[int, dict[str, float]] = {}
    for k in sorted(ks, reverse=True):
        losses[k] = {m: loss(sets[(m, k)]) for m in methods}
        ok = [m for m in methods if losses[k][m] <= target]
        if ok:
            best = min(ok, key=lambda m: (losses[k][m], methods.index(m)))
            return best, k, {"target": {"target": target, "measure": measure, "k": k, "losses": losses}}
    return methods[0], 0, {"target": {"target": target, "measure": measure, "k": 0, "losses": losses}}


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
    fidelity: Optional[Any] = None,
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
        fidelity: the measure ``target`` budgets (:mod:`~latte_plugin.core.fidelity`); default:
            the relative raw-output distortion. Detector adapters pass
            :class:`~latte_plugin.core.fidelity.DetectionDisagreement`.

    Returns:
        ``{variant, candidates, sensitivity, linearized, params, fit, selection, attention_gflops, config, ...}``.
    """
    reduce = all_reduce or (lambda t: t)
    layers = _prepare(model, cfg, batches, reduce)
    fidelity = fidelity or RawDistortion(forward, relative=True)
    was_training = model.training
    model.eval()
    rank, world = shard
    positions = list(positions) if positions is not None else [i * world + rank for i in range(len(batches))]
    split = split_calibration(list(batches), positions[: len(batches)], cfg, reduce)
    fold_of = fold_assignment(split, cfg, reduce, shard)
    fits, corrections, targets = calibrate_layers(layers, split, cfg, forward, reduce, fold_of, log, progress, shard)
    sens, shapes = score_sensitivity(layers, split.fit, forward, cfg, reduce, progress)
    k = num_linear_layers(len(layers), cfg.ratio, cfg.num_linear)
    judged = _judge_images(split, reduce)
    judge = CrossFitJudge(layers, corrections, judged, fold_of, reduce)
    chosen, trace, how = select_layers(layers, sens, k, cfg, split, forward, reduce, judge, fidelity)
    k = len(chosen) if cfg.target is not None else k
    if chosen and targets is not None and cfg.compensate != "never":
        how["compensation"] = choose_compensation(layers, chosen, split, cfg, forward, progress, reduce, shard,
                                                  targets, fold_of, corrections, judge, fits, log)
    held = heldout_figures(layers, chosen, split, forward, fidelity, reduce)
    apply_selection(layers, chosen, cfg, sens, log)
    model.train(was_training)
    report = build_report(layers, cfg, k, chosen, sens, fits, trace, split, shapes, held.get("raw_mse"))
    n_judged = int(reduce(torch.tensor([float(len(judged))], dtype=torch.float64))[0])
    report["selection"].update(how, judge_images=n_judged, heldout=held)
    return report


def apply_selection(layers: dict[str, LatteParams], chosen: list[str], cfg: LatteConfig, sens: dict[str, float],
                    log: Callable[[str], None]) -> None:
    """Puts the chosen layers in ``cfg.mode`` (the rest exact) and logs each layer's state."""
    set_modes(layers, chosen, cfg.mode)
    for layer in layers.values():
        layer.threshold.fill_(int(cfg.threshold))
    for n in layers:
        log(f"[latte] {n}: sensitivity={sens[n]:.4e} -> {'LINEAR' if n in chosen else 'exact'}")


def calibrate_layers(layers: dict[str, LatteParams], split: CalibrationSplit, cfg: LatteConfig,
                     forward: Callable[[Any], Any], reduce: AllReduce, fold_of: dict[int, int],
                     log: Callable[[str], None], progress: Callable, shard: tuple[int, int]) -> tuple[dict, dict]:
    """Records and fits every layer (one group, or layer by layer with ``sequential``).

    Returns ``(fits, corrections, exact targets)`` (:func:`fit_layers`, :func:`exact_targets`;
    no targets with ``sequential``, whose records are not the exact model's).
    """
    regs = _refit_regs(cfg, split, log)
    fits: dict[str, dict] = {}
    corrections: dict[str, tuple] = {}
    targets = None
    for group in ([[n] for n in layers] if cfg.sequential else [list(layers)]):
        recs = record_layers(layers, group, split, cfg, forward, progress, reduce, shard,
                             f"recording {group[0]}" if cfg.sequential else "recording")
        group_fits, group_corrections = fit_layers(layers, group, recs, cfg, regs, log, fold_of)
        fits.update(group_fits)
        corrections.update(group_corrections)
        if cfg.sequential:
            layers[group[0]].mode = "linear"
        else:
            targets = exact_targets(recs)
    return fits, corrections, targets


def choose_compensation(layers: dict[str, LatteParams], chosen: list[str], split: CalibrationSplit,
                        cfg: LatteConfig, forward: Callable[[Any], Any], progress: Callable, reduce: AllReduce,
                        shard: tuple[int, int], targets: dict, fold_of: dict[int, int], corrections: dict,
                        judge: CrossFitJudge, fits: dict, log: Callable[[str], None]) -> dict:
    """Compensates the chosen layers (:func:`compensate_layers`) and, with ``compensate='auto'``,
    keeps it only if the hybrid's cross-fitted raw-output MSE on the judging images is lower
    (ties keep the plain fit). Updates ``corrections`` and the layers in place; the compensated
    fits go to ``fits[layer]["compensated"]``."""
    mse = RawDistortion(forward, relative=False)
    before = judge(mse)(chosen)
    comp_fits, comp = compensate_layers(layers, chosen, split, cfg, forward, progress, reduce, shard, targets,
                                        fold_of, _refit_regs(cfg, split, log))
    after = judge(mse, {**corrections, **comp})(chosen)
    keep = cfg.compensate == "always" or after < before
    for n in chosen:
        fits[n]["compensated"] = comp_fits[n]
        if keep:
            corrections[n] = comp[n]
        kind, full, _ = corrections[n]
        set_correction(layers[n], kind, full)
    judge.forget()
    log(f"[latte] error compensation: cross-fitted output MSE {before:.4e} -> {after:.4e}: "
        f"{'kept' if keep else 'not kept'}")
    return {"crossfit_distortion": {"plain": before, "compensated": after}, "kept": keep}


def heldout_figures(layers: dict[str, LatteParams], chosen: list[str], split: CalibrationSplit,
                    forward: Callable[[Any], Any], fidelity: Any, reduce: AllReduce) -> dict:
    """The chosen layers' raw-output MSE and ``fidelity`` loss on the report images (nothing was
    fitted on them or chosen by them); empty without report images."""
    if not split.counts.get("report"):
        return {}
    return {"raw_mse": output_distortion(layers, split.report, forward, reduce)(chosen),
            "fidelity": measured(layers, split.report, fidelity, reduce)(chosen), "measure": fidelity.name}


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


def apply_inference_settings(model: nn.Module, cfg: LatteConfig, log: Callable[[str], None] = print) -> list[str]:
    """Applies the inference-time settings to a model whose LATTE state was loaded, not calibrated now.

    ``mode`` and ``threshold`` take effect at once on the layers the checkpoint made linear
    (the rest stay exact). The other fields shape calibration; ``variant`` in particular is
    kept as calibrated, and a different one is reported in one line (it needs ``calibrate='always'``).

    Returns:
        The linear (non-exact) layers, in model order.
    """
    layers = find_latte_layers(model)
    linear = [n for n, layer in layers.items() if layer.mode != "exact"]
    set_modes(layers, linear, cfg.mode)
    for layer in layers.values():
        layer.threshold.fill_(int(cfg.threshold))
    loaded = sorted({layer.variant for layer in layers.values() if bool(layer.calibrated)})
    if loaded and loaded != [cfg.variant]:
        log(f"[latte] variant={cfg.variant!r} not applied: the checkpoint was calibrated with variant "
            f"{', '.join(loaded)}, and the variant changes only by recalibrating (calibrate='always')")
    log(f"[latte] calibrated LATTE state loaded: {len(linear)} of {len(layers)} layers {cfg.mode}"
        + (f" (softmax below {int(cfg.threshold)} keys)" if cfg.mode == "dynamic" else ""))
    return linear
