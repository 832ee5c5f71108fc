"""Error compensation (``docs/method.md#compensation``): each chosen layer's output correction
refitted, in model order, on inputs recorded with the chosen layers before it already linear,
against the *exact* model's attention output there (kernel scalars kept).

A refit depends only on the rule and the chosen layers up to it, so linear shares whose sets
begin alike reuse the refits of their common beginning (``RunCaches.compensated``).
"""
from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from ..nn.install import set_modes
from .context import ROLES, CalibrationRun, no_reduce
from .corrections import FitOptions, FittedCorrection, LayerRecords, fit_correction, set_correction
from .record import record_layers
from .report import fit_entry
from .select import Configuration

__all__ = ["compensate_layers"]


def compensate_layers(run: CalibrationRun, chosen: Configuration,
                      targets: dict[str, dict[int, Tensor]]) -> tuple[dict, dict[str, FittedCorrection]]:
    """Compensates ``chosen``'s layers, leaving them linear with their compensated corrections.

    Args:
        run: the calibration. chosen: the configuration (its rule and layers, in model order).
        targets: ``{layer: {item key: exact attention output}}`` of the exact model's records.

    Returns:
        ``({layer: report entry}, {layer: FittedCorrection})``.
    """
    fits, corrections = {}, {}
    set_modes(run.layers, [])
    for i, n in enumerate(chosen.layers):
        key = (chosen.rule, tuple(chosen.layers[: i + 1]))
        if key not in run.caches.compensated:
            run.caches.compensated[key] = _compensate_layer(run, n, chosen.rule, targets)
        entry, corrections[n] = run.caches.compensated[key]
        fits[n] = dict(entry)
        set_correction(run.layers[n], corrections[n].kind, corrections[n].weights)
        run.layers[n].mode = "linear"
    return fits, corrections


def _compensate_layer(run: CalibrationRun, n: str, rule: str,
                      targets: dict[str, dict[int, Tensor]]) -> tuple[dict, FittedCorrection]:
    """Records layer ``n`` in the model as it stands and refits its ``rule`` correction to the
    exact model's outputs: ``(report entry, FittedCorrection)``."""
    recs = record_layers(run, [n], f"compensating {n}")
    for role in ROLES:
        for it in recs[role][n].items:
            it.target = targets[n][it.key]
    records = LayerRecords(recs["fit"][n].items, recs["choose"][n].items, recs["report"][n].items)
    opts = FitOptions(correction=rule, refit_regs=tuple(run.cfg.refit_reg), fold_of=run.fold_of, all_reduce=no_reduce)
    res = fit_correction(run.layers[n], records, opts)
    return fit_entry(res), replace(res.rules[rule], origin="compensation")
