"""One calibration run as typed state: what the caller supplies (:class:`Host`), the images'
roles (:class:`CalibrationSplit`) and what every step shares (:class:`CalibrationRun`).

A run is built once by the flow and is frozen: a step reads it and returns its results; it
never writes into it. Its :class:`RunCaches` are the only state shared across steps and across
the linear shares of one calibration, named as such.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from torch import Tensor

from ..nn.params import LatteParams
from .config import AUTO_SELECTIONS, EVIDENCE_FALLBACK_RULES, EVIDENCE_REFERENCE, EVIDENCE_SELECTIONS, LatteConfig

__all__ = ["AllReduce", "no_reduce", "Progress", "no_progress", "Measure", "Host", "ROLES", "CalibrationSplit",
           "RunCaches", "CalibrationRun"]

#: Sums a tensor across ranks in place and returns it (the identity in one process).
AllReduce = Callable[[Tensor], Tensor]
#: Wraps an iterable in a progress bar: ``progress(iterable, total, description)``.
Progress = Callable[[Iterable, int, str], Iterable]


def no_reduce(t: Tensor) -> Tensor:
    """The all-reduce of one process: the identity."""
    return t


def no_progress(it: Iterable, total: int, desc: str) -> Iterable:
    """No progress bar."""
    return it


class Measure(Protocol):
    """What judges a linear set on some images (``latte_plugin.calibration.measures``): run a
    batch, turn a reference and an output into additive sums, and the sums into one loss."""

    name: str

    def run(self, batch: Any) -> Any: ...

    def zeros(self) -> Tensor: ...

    def sums(self, ref: Any, out: Any) -> Tensor: ...

    def loss(self, total: Tensor) -> float: ...


@dataclass(frozen=True)
class Host:
    """What the caller of a calibration supplies (an adapter: ``latte_plugin.adapter``).

    Attributes:
        forward: runs the model on one batch; returns its raw outputs (tensors, nested ok).
        all_reduce: sums a float64 tensor across ranks in place.
        log: receives progress lines. progress: wraps an iterable in a progress bar.
        shard: ``(rank, world_size)``.
        positions: the global position of each local batch (``latte_plugin.adapter.take_batches``);
            ``None``: dealt round-robin, local batch ``i`` is global batch ``i * world_size + rank``.
        fidelity: the measure ``target`` budgets and ``judge='detections'`` uses; detector
            adapters give :class:`~latte_plugin.calibration.measures.DetectionDisagreement`;
            ``None``: the relative raw-output distortion (and no detection judge).
    """

    forward: Callable[[Any], Any]
    all_reduce: AllReduce = no_reduce
    log: Callable[[str], None] = print
    progress: Progress = no_progress
    shard: tuple[int, int] = (0, 1)
    positions: Optional[Sequence[int]] = None
    fidelity: Optional[Measure] = None


#: The roles of calibration images: fitted on; choosing the knobs; only reporting held-out errors.
ROLES = ("fit", "choose", "report")


@dataclass
class CalibrationSplit:
    """This rank's calibration batches by role, each as ``(global position, batch)``.

    The roles come from the global position alone (``judge.image_role``), so the split is the
    same whatever the number of processes. ``used`` (the fit and choice images) is dealt to
    ``halves``: two when whole configurations are compared (each half searches, the other
    judges: ``docs/method.md#configurations``), else one. ``greedy[i]``: the images of half
    ``i`` the greedy and backward searches compare outputs on (a search over every image
    measures on all of them together). Built by ``judge.split_calibration``, then only read.
    """

    fit: list = field(default_factory=list)
    choose: list = field(default_factory=list)
    report: list = field(default_factory=list)
    used: list = field(default_factory=list)
    halves: list = field(default_factory=list)
    greedy: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)


@dataclass
class RunCaches:
    """Results a run remembers across its steps and its linear shares; each saves forwards and
    changes no figure (``docs/architecture.md#recording``).

    Attributes:
        runs_once: the layers seen to run exactly once per forward (``record.record_layers``).
        compensated: ``{(rule, layers up to and including one): (report entry, FittedCorrection)}``
            (``compensate.compensate_layers``).
    """

    runs_once: set = field(default_factory=set)
    compensated: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CalibrationRun:
    """What every step of one calibration reads (built once by the flow's ``_start``).

    ``dataclasses.replace(run, cfg=...)`` gives a linear share its own settings over the same
    layers, images and :class:`RunCaches` (shared on purpose).

    Attributes:
        layers: ``{name: LatteParams}`` in model order. cfg: the settings (validated).
        split: the images' roles. fold_of: ``{global position: fold}`` of the fit and choice images.
        host: what the caller supplied. judge: what judges whole configurations and the
            compensation. fidelity: what ``target`` budgets and the report's held-out figure measures.
        caches: see :class:`RunCaches`.
    """

    layers: dict[str, LatteParams]
    cfg: LatteConfig
    split: CalibrationSplit
    fold_of: dict[int, int]
    host: Host
    judge: Measure
    fidelity: Measure
    caches: RunCaches = field(default_factory=RunCaches)

    @property
    def forward(self) -> Callable[[Any], Any]:
        return self.host.forward

    @property
    def reduce(self) -> AllReduce:
        return self.host.all_reduce

    @property
    def log(self) -> Callable[[str], None]:
        return self.host.log

    @property
    def progress(self) -> Progress:
        return self.host.progress

    @property
    def shard(self) -> tuple[int, int]:
        return self.host.shard

    @property
    def rules(self) -> tuple:
        """The correction rules whole configurations compare (the user's, or all with ``auto``)."""
        return tuple(self.cfg.correction_rules) if self.cfg.correction == "auto" else (self.cfg.correction,)

    @property
    def methods(self) -> tuple:
        """The selection methods whole configurations compare (the user's, or all with ``auto``)."""
        if self.cfg.selection != "auto":
            return (self.cfg.selection,)
        return AUTO_SELECTIONS if self.cfg.reference == "paper" else EVIDENCE_SELECTIONS

    @property
    def reference(self) -> str:
        """The configuration the noise rule keeps unless another clearly wins: the first pair with
        ``reference='paper'``; else :data:`~.config.EVIDENCE_REFERENCE`, with the user's own
        selection or correction where they fixed one."""
        methods, rules = self.methods, self.rules
        if self.cfg.reference == "paper":
            return f"{methods[0]}+{rules[0]}"
        method = EVIDENCE_REFERENCE[0] if EVIDENCE_REFERENCE[0] in methods else methods[0]
        rule = next((r for r in (EVIDENCE_REFERENCE[1], *EVIDENCE_FALLBACK_RULES) if r in rules), rules[0])
        return f"{method}+{rule}"
