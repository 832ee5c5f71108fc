"""The user's settings: :class:`LatteConfig` (the same keys in every adapter and as
``tools/calibrate.py`` flags), every closed vocabulary and every default, in one place.

A ``LatteConfig`` is frozen and validated once, when it is built (:meth:`LatteConfig.from_dict`
at each entry point): a calibration never sees an invalid one, and no step validates again.
The two decisions every adapter makes with a config when a model is built (calibrate now, or
apply the inference settings to a loaded calibration) are in :mod:`latte_plugin.calibration.state`.
The method behind each setting: ``docs/method.md``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

from ..ops import BACKENDS, ORDERS, PIECEWISE_BLOCK, RESTS, VARIANTS

__all__ = ["LatteConfig", "VARIANTS", "BACKENDS", "SELECTIONS", "CALIBRATE", "COMPENSATE", "JUDGES", "SEARCHES",
           "INFERENCE_MODES", "CHOOSE_FOR", "CORRECTIONS", "CORRECTION_RULES", "PREVIOUS_CORRECTION_RULES", "EVIDENCE_FALLBACK_RULES", "REFIT_REGS", "REFIT_FALLBACK", "CROSS_FIT_FOLDS",
           "STEP_CHECKPOINTS", "AUTO_SELECTIONS", "EVIDENCE_SELECTIONS", "EVIDENCE_REFERENCE", "REFERENCES", "FINAL_SETS", "KERNEL_CHOICES", "PIECEWISE_TOPS", "PIECEWISE_GAMMAS",
           "PIECEWISE_SLACK", "num_linear_layers"]

#: Layer selections; ``auto`` compares the others as parts of whole configurations, judged end to
#: end by cross-fitting (``core.choice``).
SELECTIONS = ("score", "greedy", "backward", "auto")
#: When a model calibrates: ``auto`` only if its LATTE layers hold no calibrated state,
#: ``always`` even if they do, ``never`` (an uncalibrated model is then an error).
CALIBRATE = ("auto", "always", "never")
#: Error compensation after the selection: ``auto`` keeps it only where it lowers the
#: judge's cross-fitted loss (``judge``).
COMPENSATE = ("auto", "always", "never")
#: What judges whole configurations and the compensation: the raw outputs, the detections,
#: ``auto`` (the detections where the adapter runs the detector's post-processing), or ``matched``
#: (the raw outputs of a set-prediction detector with its query slots matched by box; it also
#: measures the speed search's single layers).
JUDGES = ("outputs", "detections", "auto", "matched")
#: What the greedy and backward searches (and the speed search's single layers) compare a set's
#: outputs with: the raw outputs slot by slot, or ``matched`` (a set-prediction detector's query
#: slots matched by box first: DEIMv2 and RT-DETR take their queries from the encoder's top scores,
#: so a change upstream reorders the slots).
SEARCHES = ("outputs", "matched")
#: What the selection optimises: a layer count (the paper's protocol) or the predicted speed-up.
CHOOSE_FOR = ("count", "speed")
#: Modes of the selected layers at inference.
INFERENCE_MODES = ("linear", "dynamic")


#: L-BFGS iteration counts compared on the choice items (capped at ``steps``).
STEP_CHECKPOINTS = (5, 10, 20, 40, 80)
#: Ridge strengths of the output refit, relative to the mean energy of its inputs.
REFIT_REGS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
#: Ridge strength used when fewer than two folds hold images to choose it by cross-fitting
#: (the more cautious of the values chosen on the embedded models: docs/results.md).
REFIT_FALLBACK = 0.01
#: Output corrections: none, the paper's per-channel sigma, the ridge refit of the whole output,
#: or ``auto``: the one of these (refit at each strength) with the lowest cross-fitted error; or
#: ``diag``: the refit plus a linear term in each query's own value (self-attention).
CORRECTIONS = ("none", "sigma", "refit", "auto", "diag")
#: The correction rules whole configurations compare under ``correction='auto'`` (the paper's sigma
#: first). ``diag`` joined them after the design calibrations' judge losses (docs/method.md#diag):
#: it is judged on the set the search found under ``auto``, like every other rule, and taken only
#: where it beats the reference by more than its noise.
CORRECTION_RULES = ("sigma", "refit", "auto", "diag")
#: The rules before ``diag`` joined them (``correction_rules=PREVIOUS_CORRECTION_RULES``: the defaults of 0.x
#: up to that change, and a cheaper calibration).
PREVIOUS_CORRECTION_RULES = ("sigma", "refit", "auto")
#: Folds of the cross-fitting behind ``correction='auto'``.
CROSS_FIT_FOLDS = 4


#: The kernel of the linear layers: ``latte``, ``piecewise`` (exact softmax on the top key blocks of
#: each query block, the rest approximated: ``docs/method.md#piecewise``), or ``auto`` (per linear
#: layer, the one with the lower cross-fitted reconstruction error).
KERNEL_CHOICES = ("latte", "piecewise", "auto")
#: Exact key blocks per query block the piecewise calibration compares (a fixed count: the cost is
#: linear in the tokens, ``docs/method.md#piecewise``).
PIECEWISE_TOPS = (1, 2, 4, 8)
#: Mass scales of the approximated blocks it compares (exp of a block's mean key is below its
#: mean exp: a scale >= 1 makes up for it). Up to 8: on the ViT blocks the first grid's top, 3,
#: was often the choice (results/piecewise_layers_deimv2_vit.json of that grid, in git history).
PIECEWISE_GAMMAS = (1.0, 1.5, 2.0, 3.0, 5.0, 8.0)
#: The piecewise calibration keeps the fewest exact blocks whose error is within this factor of
#: the best count's (set before any measurement: a 10% worse reconstruction for a cheaper layer).
PIECEWISE_SLACK = 1.1


#: Selections compared by ``selection='auto'`` under ``reference='paper'``, the paper's score first
#: (it wins ties).
AUTO_SELECTIONS = ("score", "greedy", "backward")
#: Selections compared by ``selection='auto'`` under ``reference='evidence'`` (the default): the
#: backward search is dropped, its sets equalled the greedy search's in the design calibrations
#: (``python -m experiments.reference_evidence``); greedy first (it wins ties).
EVIDENCE_SELECTIONS = ("greedy", "score")
#: The reference of ``reference='evidence'``: the (selection, correction) pair of lowest mean
#: cross-fitted judge loss relative to each calibration's best, over the design calibrations of
#: both 256 px detectors (seeds 202-606): ``greedy+refit`` at 8-64 images with the rules before
#: ``diag`` (``results/reference_evidence.json``), ``greedy+diag`` at 8 and 32 images at 67% and 83%
#: once ``diag`` joined them (``python -m experiments.reference_evidence --pattern
#: results/design_rules_diag.json``; judge losses only, no val mAP). Where the user fixes one of the
#: two, the reference takes the user's.
EVIDENCE_REFERENCE = ("greedy", "diag")
#: The reference's rule where the user's ``correction_rules`` lack ``EVIDENCE_REFERENCE``'s: the
#: first of these among them (the reference of the design calibrations before ``diag`` joined
#: the rules, ``results/reference_evidence.json``), else the first rule.
EVIDENCE_FALLBACK_RULES = ("refit",)
#: What the noise rule of the configuration choice measures against: ``evidence`` (the reference
#: above, a moderated standard error, and compensation under the same rule) or ``paper`` (the
#: paper's score with sigma as reference, the plain standard error: the earlier rule).
REFERENCES = ("evidence", "paper")
#: How the final linear set of a searched configuration is picked (``docs/method.md#final-set``):
#: ``confirm`` judges the searches' sets on the images no search compared outputs on; ``search``
#: takes the halves' common set, else the set searched again on every search image (the rule before);
#: ``pooled`` searches again even where the halves agree, then confirms as ``confirm`` does.
FINAL_SETS = ("confirm", "search", "pooled")


def _opt(default: Any, help: str, choices: Optional[Sequence[str]] = None, nargs: Optional[str] = None) -> Any:
    """A ``LatteConfig`` field with its help text (and choices, or the number of values its flag
    takes) as metadata: the one place that ``tools/calibrate.py``'s flags, ``--help`` and the docs
    read them from."""
    meta = {"help": help, **({"choices": tuple(choices)} if choices else {}), **({"nargs": nargs} if nargs else {})}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
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
                                   "(ridge refit of the whole output), auto (per layer, the candidate with the "
                                   "lowest cross-fitted error; with the default correction='auto', also the "
                                   "rule each whole configuration is judged under), or diag (the refit plus a "
                                   "linear term in each query's own value, in self-attention)", CORRECTIONS)
    correction_rules: Sequence[str] = _opt(CORRECTION_RULES, "the correction rules that correction='auto' judges "
                                                             "whole configurations under (each of none, sigma, "
                                                             "refit, auto, diag; the reference's rule among them)")
    refit_reg: Sequence[float] = _opt(REFIT_REGS, "candidate ridge strengths of the refit, relative to the input "
                                                  "energy (chosen on held-out images)")
    holdout: float = _opt(0.0, "fraction of calibration images held out, in [0, 1): half of them choose the "
                               "L-BFGS step count, the other half only report held-out errors and are never "
                               "fitted on; 0 (the default) fits every image and reports cross-fitted figures")
    per_head: bool = _opt(False, "fit one (alpha, rho) per head instead of one per layer")
    signal: bool = _opt(True, "measure each candidate's signal for the report (how much the exact model's "
                              "outputs move with that layer's attention replaced by its mean; one forward per "
                              "candidate per calibration image): --no-signal skips it")
    sequential: bool = _opt(False, "fit layer l on inputs from the model with the layers before it already linear")
    compensate: str = _opt("auto", "error compensation after the selection: refit each linear layer's output "
                                   "correction on inputs from the hybrid against the exact model's outputs; auto "
                                   "keeps it only if the judge's cross-fitted loss is lower", COMPENSATE)
    selection: str = _opt("auto", "greedy (add the layer that hurts the final output least), backward (start "
                                  "all-linear, restore the most harmful), score (the paper's per-layer score), or "
                                  "auto (compare greedy and score, each with every correction rule, end to end by "
                                  "cross-fitting; the reference is kept unless another wins by more than its noise)",
                          SELECTIONS)
    reference: str = _opt("evidence", "what a configuration must beat, by more than its noise, to be chosen under "
                                      "selection=auto or correction=auto: evidence (greedy with refit, the pair that "
                                      "judged best across the design calibrations; the noise from a standard error "
                                      "shrunk toward the other candidates'; compensation under the same rule) or "
                                      "paper (the paper's score with sigma, backward searched too, the plain standard "
                                      "error: the earlier rule)", REFERENCES)
    judge: str = _opt("outputs", "what judges whole configurations and the compensation, cross-fitted: outputs (the "
                                 "raw-output MSE), detections (1 - agreement of the detections with the exact "
                                 "model's; detectors only), auto (detections for detectors, else outputs), or matched (the "
                                 "raw-output MSE with a DETR-style detector's query slots matched by box)", JUDGES)
    search: str = _opt("outputs", "what the greedy and backward searches and the speed search's single layers compare "
                                  "a set with, cross-fitted: outputs (the raw-output MSE slot by slot) or matched "
                                  "(the same with a DETR-style detector's query slots matched by box first)", SEARCHES)
    target: Optional[float] = _opt(None, "fidelity budget in (0, 1) instead of a count: the most layers whose "
                                         "cross-fitted fidelity loss stays within it; for detectors 1 - agreement "
                                         "of the detections with the exact model's (0.05 keeps 95 percent), else the "
                                         "relative raw-output distortion (ratio and num_linear are then ignored)")
    speedup: Optional[float] = _opt(None, "predicted end-to-end speed-up to reach at the calibration input size "
                                          "instead of a count: per-layer modes (exact, latte, piecewise at each "
                                          "block count) with the lowest cross-fitted distortion whose speed-up, "
                                          "from the layers' timed costs, is at least this (implies "
                                          "choose_for=speed; ratio and num_linear are then ignored)")
    input_size: Optional[tuple] = _opt(None, "deployment input size, H [W] pixels (one value: square): the "
                                             "adapters resize the calibration images to it (the test pipeline's "
                                             "resize, its aspect rule kept), so the fits, the choice and the cost "
                                             "model are at that size; tools/calibrate.py evaluates at it too. "
                                             "Default: the config's test size", nargs="+")
    cost_model: Optional[str] = _opt(None, "a JSON cost model to choose for speed with instead of timing the layers "
                                           "here (measured on the deployment machine): {\"exact_ms\": end-to-end ms, "
                                           "\"layers_ms\": {layer or fnmatch pattern: {mode: ms}}}, e.g. a report's "
                                           "speed.cost")
    choose_for: str = _opt("count", "what the selection optimises: count (a layer count: ratio, num_linear, or "
                                    "the most layers within target; the paper's protocol) or speed (per-layer modes "
                                    "for speedup, or the highest predicted speed-up within target)", CHOOSE_FOR)
    lam: float = _opt(10.0, "lambda of the sensitivity score")
    final_set: str = _opt("confirm", "how a searched configuration's final set is picked: confirm (each half's set "
                                     "and, where they differ, the set searched again on every search image, judged "
                                     "cross-fitted on the fit and choice images no search compared outputs on: the "
                                     "lowest loss is kept), search (the halves' common set, else the set searched "
                                     "again: the rule before) or pooled (as confirm, but the search runs again on "
                                     "every search image even where the halves agree)", FINAL_SETS)
    greedy_images: int = _opt(8, "calibration images the greedy and backward searches compare outputs on (at most "
                                 "the first half of the images when configurations are compared: the rest judge)")
    mode: str = _opt("linear", "mode of the selected layers at inference: linear, or dynamic (softmax below "
                               "threshold keys); applies to a loaded calibration too", INFERENCE_MODES)
    # Crossover measured by benchmarks/attention.py on 2 idle CPU cores (fp32, 8 heads of 32):
    # LATTE is 0.46x SDPA at 128 tokens, even at 256 (1.03x), faster from 512 (docs/deployment.md, Performance).
    threshold: int = _opt(256, "key count below which dynamic layers use softmax (the measured CPU crossover; "
                               "re-measure on your hardware); applies to a loaded calibration too")
    seed: int = _opt(0, "seeds the calibration sampler and the recorders' keyed sampling")
    calibrate: str = _opt("auto", "auto (only if the model holds no LATTE state), always, or never (an "
                                  "uncalibrated model is an error)", CALIBRATE)
    backend: Optional[str] = _opt(None, "kernel of the linear layers: auto (Triton on CUDA, else eager), eager, "
                                        "compiled (torch.compile on CPU) or triton; default: the LATTE_KERNEL "
                                        "environment variable, else auto; chosen once when the layers are built "
                                        "or loaded; applies to a loaded calibration too", BACKENDS)

    kernel: str = _opt("latte", "kernel of the linear layers: latte (the calibrated Taylor kernel), piecewise "
                                "(exact softmax on the top key blocks of each query block, the rest approximated "
                                "around the blocks' mean keys), or auto (per linear layer, the one with the lower "
                                "cross-fitted reconstruction error)", KERNEL_CHOICES)
    piecewise_top: Optional[int] = _opt(None, "exact key blocks per query block of a piecewise layer; default: "
                                              "calibrated per layer among 1, 2, 4 and 8")
    piecewise_block: int = _opt(PIECEWISE_BLOCK, "tokens per block of the piecewise kernel (about that many with "
                                                 "piecewise_order=similarity or lowrank)")
    piecewise_order: str = _opt("similarity", "how a piecewise layer forms its blocks: tokens (consecutive tokens, "
                                              "PISA's blocks), similarity (similar tokens together, by balanced "
                                              "bisection of each input's queries and keys) or lowrank (the same "
                                              "bisection in their top 16 principal directions: cheaper, no ONNX)",
                                ORDERS)
    # latte: lower held-out error than blockmean on all 6 ViT blocks (results/piecewise_layers_deimv2_vit.json)
    piecewise_rest: str = _opt("latte", "how a piecewise layer approximates the keys outside its exact blocks: "
                                        "latte (the calibrated LATTE kernel spreads the blocks' mass) or blockmean "
                                        "(each block's mean value, plus a shared first-order term)", RESTS)

    def __post_init__(self) -> None:
        # the two fields that take a single value for convenience, normalised once
        if isinstance(self.refit_reg, (int, float)):
            object.__setattr__(self, "refit_reg", (float(self.refit_reg),))
        if isinstance(self.candidates, str):
            object.__setattr__(self, "candidates", (self.candidates,))
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "refit_reg", tuple(self.refit_reg))
        rules = self.correction_rules
        object.__setattr__(self, "correction_rules", (rules,) if isinstance(rules, str) else tuple(rules))
        object.__setattr__(self, "input_size", _input_size(self.input_size))
        self.validate()

    @property
    def for_speed(self) -> bool:
        """Whether the selection assigns per-layer modes for speed (``speedup`` or ``choose_for='speed'``)."""
        return self.speedup is not None or self.choose_for == "speed"

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """``{field: help}`` of every field."""
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}

    def _check_corrections(self) -> None:
        """``correction`` and ``correction_rules``: each one of :data:`CORRECTIONS`."""
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown output correction {self.correction!r}; choose one of {', '.join(CORRECTIONS)}")
        if not self.correction_rules or any(r not in CORRECTIONS for r in self.correction_rules):
            raise ValueError(f"correction_rules {list(self.correction_rules)!r}: give one or more of {', '.join(CORRECTIONS)}")

    def validate(self) -> "LatteConfig":
        """Checks every field (done once, at construction); raises ``ValueError`` naming the bad one."""
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown LATTE variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown selection {self.selection!r}; choose one of {', '.join(SELECTIONS)}")
        self._check_corrections()
        if self.target is not None and not 0.0 < float(self.target) < 1.0:
            raise ValueError(f"target (a fidelity loss budget, e.g. 0.05 keeps 95%) must be in (0, 1), got {self.target}")
        if self.speedup is not None and not (math.isfinite(float(self.speedup)) and float(self.speedup) >= 1.0):
            raise ValueError(f"speedup (a predicted end-to-end speed-up, e.g. 1.4) must be >= 1, got {self.speedup}")
        if self.choose_for not in CHOOSE_FOR:
            raise ValueError(f"choose_for must be one of {', '.join(CHOOSE_FOR)}, got {self.choose_for!r}")
        if self.choose_for == "speed" and self.speedup is None and self.target is None:
            raise ValueError("choose_for='speed' needs speedup= (a speed-up to reach) or target= (a fidelity budget)")
        if self.speedup is not None and self.target is not None:
            raise ValueError("give speedup= or target=, not both: one is the constraint, the other is optimised")
        if self.compensate not in COMPENSATE:
            raise ValueError(f"compensate must be one of {', '.join(COMPENSATE)}, got {self.compensate!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if self.final_set not in FINAL_SETS:
            raise ValueError(f"final_set must be one of {', '.join(FINAL_SETS)}, got {self.final_set!r}")
        if self.judge not in JUDGES:
            raise ValueError(f"judge must be one of {', '.join(JUDGES)}, got {self.judge!r}")
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.calibrate not in CALIBRATE:
            raise ValueError(f"calibrate must be one of {', '.join(CALIBRATE)}, got {self.calibrate!r}")
        if self.mode not in INFERENCE_MODES:
            raise ValueError(f"mode of the selected layers must be 'linear' or 'dynamic', got {self.mode!r}")
        if self.num_linear is None:
            num_linear_layers(1, ratio=self.ratio)  # validates the ratio
        if not 0.0 <= float(self.holdout) < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (or unset), got {self.backend!r}")
        if self.kernel not in KERNEL_CHOICES:
            raise ValueError(f"kernel must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernel!r}")
        if self.piecewise_rest not in RESTS:
            raise ValueError(f"piecewise_rest must be one of {', '.join(RESTS)}, got {self.piecewise_rest!r}")
        if self.piecewise_order not in ORDERS:
            raise ValueError(f"piecewise_order must be one of {', '.join(ORDERS)}, got {self.piecewise_order!r}")
        if self.piecewise_top is not None and int(self.piecewise_top) < 1:
            raise ValueError(f"piecewise_top must be >= 1 (or unset: calibrated), got {self.piecewise_top}")
        if int(self.piecewise_block) < 1:
            raise ValueError(f"piecewise_block must be >= 1, got {self.piecewise_block}")
        if not self.refit_reg or any(float(r) < 0 for r in self.refit_reg):
            raise ValueError(f"refit_reg must be non-empty and >= 0, got {self.refit_reg}")
        for name in ("num_images", "max_items", "max_queries", "greedy_images"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if int(self.steps) < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
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
        return cls(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["candidates"] = list(d["candidates"])
        d["refit_reg"] = [float(r) for r in d["refit_reg"]]
        d["input_size"] = None if self.input_size is None else list(self.input_size)
        return d


def _input_size(value: Any) -> Optional[tuple[int, int]]:
    """``input_size`` as ``(height, width)``: one side for a square, or two.

    Raises:
        ValueError: not one or two positive whole numbers of pixels.
    """
    if value is None:
        return None
    sides = (value,) if isinstance(value, (int, float)) else tuple(value)
    if len(sides) not in (1, 2) or any(float(v) != int(v) or int(v) < 1 for v in sides):
        raise ValueError(f"input_size must be one or two positive pixel counts (H [W]), got {value!r}")
    return int(sides[0]), int(sides[-1])


def num_linear_layers(num_candidates: int, ratio: Optional[float] = None, count: Optional[int] = None) -> int:
    """How many candidates go linear: ``count`` if given, else ``ratio`` rounded half up.

    Raises:
        ValueError: ratio outside (0, 1], count outside [0, num_candidates], or neither given.
    """
    if count is not None:
        if not 0 <= int(count) <= num_candidates:
            raise ValueError(f"num_linear={count} must be between 0 and the {num_candidates} candidate layers")
        return int(count)
    if ratio is None:
        raise ValueError("give either a ratio in (0, 1] or a layer count")
    if not (0.0 < float(ratio) <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return int(math.floor(ratio * num_candidates + 0.5))
