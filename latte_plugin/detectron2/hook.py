"""``LinearizeHook``: a detectron2 ``HookBase`` that only decides *when* to calibrate."""
from __future__ import annotations

import logging
from typing import Any, Optional

from detectron2.engine import HookBase

from ..core.settings import LatteConfig, apply_inference_settings, needs_calibration
from ..adapter import swap_attention
from .calibrate import calibrate_detector, unwrap

__all__ = ["LinearizeHook"]


class LinearizeHook(HookBase):
    """Calibrates LATTE before training from the trainer's train loader.

    Args:
        latte: ``LatteConfig`` fields (or a ``LatteConfig``); ``calibrate``: ``auto`` (only if
            the model holds no calibrated LATTE state), ``always`` or ``never`` (an
            uncalibrated model is an error), as everywhere else.
        loader: a built loader to calibrate on; default ``trainer.data_loader`` (the train split).
    """

    def __init__(self, latte: Any = None, loader: Optional[Any] = None) -> None:
        self.cfg = latte if isinstance(latte, LatteConfig) else LatteConfig.from_dict(dict(latte or {}))
        self.loader = loader
        self.report: Optional[dict] = None

    def before_train(self) -> None:
        model = unwrap(self.trainer.model)
        swap_attention(model, self.cfg.candidates, self.cfg.variant)
        if needs_calibration(model, self.cfg.calibrate):
            loader = self.loader if self.loader is not None else self.trainer.data_loader
            self.report = calibrate_detector(self.trainer.model, loader, self.cfg)
        else:  # a loaded calibration: mode and threshold apply now
            apply_inference_settings(model, self.cfg, logging.getLogger("detectron2").info)
