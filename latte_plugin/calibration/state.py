"""What a model's LATTE layers hold, and the two decisions every adapter makes with it when a
model is built: calibrate now (:func:`needs_calibration`), or apply the inference-time settings
to a loaded calibration (:func:`apply_inference_settings`)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..nn.install import find_latte_layers, set_backend, set_modes
from .config import CALIBRATE, LatteConfig

__all__ = ["needs_calibration", "apply_inference_settings"]


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

    ``mode``, ``threshold`` and ``backend`` take effect at once on the layers the checkpoint made linear
    (the rest stay exact). The other fields shape calibration; ``variant`` in particular is
    kept as calibrated, and a different one is reported in one line (it needs ``calibrate='always'``).

    Returns:
        The linear (non-exact) layers, in model order.
    """
    layers = find_latte_layers(model)
    linear = [n for n, layer in layers.items() if layer.mode != "exact"]
    set_modes(layers, linear, cfg.mode)
    set_backend(model, cfg.backend)
    for layer in layers.values():
        layer.threshold.fill_(int(cfg.threshold))
    loaded = sorted({layer.variant for layer in layers.values() if bool(layer.calibrated)})
    if loaded and loaded != [cfg.variant]:
        log(f"[latte] variant={cfg.variant!r} not applied: the checkpoint was calibrated with variant "
            f"{', '.join(loaded)}, and the variant changes only by recalibrating (calibrate='always')")
    log(f"[latte] using the calibrated LATTE state loaded from the checkpoint: {len(linear)} of {len(layers)} "
        f"layers {cfg.mode}"
        + (f" (softmax below {int(cfg.threshold)} keys)" if cfg.mode == "dynamic" else ""))
    return linear
