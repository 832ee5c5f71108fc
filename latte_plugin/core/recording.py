"""The flow's forward passes that record layers: every candidate at once, or one layer at a
time for error compensation (``docs/method.md#compensation``).

Two savings that leave every figure as it was (``docs/architecture.md#recording``):

* A one-layer recording of a layer that an earlier full recording saw run exactly once
  per forward stops the forward as soon as that layer has its batch
  (:class:`~latte_plugin.core.calibration.RecordingDone`): nothing after it can change what
  it recorded.
* Compensation refits each chosen layer on inputs recorded with the chosen layers before it
  linear; that depends only on those layers and the rule, so shares whose sets begin alike
  (``calibrate_model_ratios``) reuse the refits of their common beginning.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from .calibration import LayerRecorder, RecordingDone, fit_correction, no_reduce, set_correction, share_items
from .judge import ROLES
from .layer import set_modes
from .report import fit_entry

if TYPE_CHECKING:  # the flow's shared state; imported for the annotations only
    from .choice import Configuration
    from .flow import _Run

__all__ = ["record_layers", "runs_once", "compensate_layers"]


def record_layers(run: "_Run", group: list[str], desc: str) -> dict[str, dict[str, LayerRecorder]]:
    """Runs every role's batches once with recorders on ``group``: ``{role: {layer: recorder}}``.

    Each image is keyed by its global position, so sampling and the ``max_items`` budget
    (applied across ranks) do not depend on the number of processes. A recording run to the
    end adds the layers that ran once per forward to ``run.runs_once``; a one-layer recording
    of such a layer stops each forward after it.
    """
    cfg, layers = run.cfg, run.layers
    recs = {role: {n: LayerRecorder(n, cfg.max_items, cfg.max_queries, cfg.seed) for n in group} for role in ROLES}
    stop = len(group) == 1 and group[0] in run.runs_once
    forwards = 0
    try:
        for role in ROLES:
            part = getattr(run.split, role)
            for n in group:
                layers[n].recorder = recs[role][n]
                recs[role][n].stop_after = stop
            label = desc if role == "fit" else f"{desc} ({role} images)"
            for pos, batch in run.progress(part, len(part), label):
                for n in group:
                    recs[role][n].batch_key = pos
                try:
                    run.forward(batch)
                except RecordingDone:  # the layer has its batch; the rest of the model is not needed
                    pass
            forwards += len(part)
    finally:
        for n in group:
            layers[n].recorder = None
    for role in ROLES:
        for rec in recs[role].values():
            share_items(rec, run.reduce, run.shard)
    if not stop:  # how often a layer runs per forward does not depend on the modes: any full recording tells
        run.runs_once |= runs_once(recs, forwards, run.reduce)
    return recs


def runs_once(recs: dict[str, dict[str, LayerRecorder]], forwards: int, all_reduce: Any) -> set[str]:
    """The layers whose recorders were called exactly once in each of ``forwards`` forwards
    (this rank's), on every rank: those a one-layer recording may stop after."""
    names = list(recs[ROLES[0]])
    bad = torch.tensor([float(sum(recs[r][n].calls for r in ROLES) != forwards or any(recs[r][n].repeated for r in ROLES))
                        for n in names], dtype=torch.float64)
    bad = all_reduce(bad)
    return {n for n, b in zip(names, bad.tolist()) if b == 0}


def compensate_layers(run: "_Run", chosen: "Configuration", targets: dict) -> tuple[dict, dict]:
    """Error compensation: in model order, each chosen layer is recorded with the chosen layers
    before it already linear (and compensated), and its output correction (the chosen rule)
    is refitted to map those inputs to the *exact* model's attention output there (kernel
    scalars kept). A refit already made for the same layers before it (another share) is reused.

    Returns ``({layer: report entry}, {layer: FittedCorrection})``.
    """
    fits, corrections = {}, {}
    set_modes(run.layers, [])
    for i, n in enumerate(chosen.layers):
        key = (chosen.rule, tuple(chosen.layers[: i + 1]))
        if key not in run.compensated:
            run.compensated[key] = _compensate_layer(run, n, chosen.rule, targets)
        entry, corrections[n] = run.compensated[key]
        fits[n] = dict(entry)
        set_correction(run.layers[n], corrections[n].kind, corrections[n].weights)
        run.layers[n].mode = "linear"
    return fits, corrections


def _compensate_layer(run: "_Run", n: str, rule: str, targets: dict) -> tuple[dict, Any]:
    """Records layer ``n`` in the model as it stands and refits its ``rule`` correction to the
    exact model's outputs: ``(report entry, FittedCorrection)``."""
    recs = record_layers(run, [n], f"compensating {n}")
    for role in ROLES:
        for it in recs[role][n].items:
            it.target = targets[n][it.key]
    res = fit_correction(run.layers[n], recs["fit"][n].items, rule, no_reduce,
                         recs["choose"][n].items, recs["report"][n].items, tuple(run.cfg.refit_reg), run.fold_of)
    return fit_entry(res), replace(res.rules[rule], origin="compensation")
