"""``LinearizeHook``: a detectron2 ``HookBase`` that only decides *when* to calibrate."""
from __future__ import annotations

from typing import Any, Optional

from detectron2.engine import HookBase

from ..core.flow import LatteConfig
from .calibrate import calibrate_d2_model

__all__ = ["LinearizeHook"]


class LinearizeHook(HookBase):
    """Calibrates LATTE before training / evaluation from the trainer's train loader.

    Args:
        latte: ``LatteConfig`` fields (or a ``LatteConfig``).
        loader: a built loader to calibrate on; default ``trainer.data_loader`` (the train split).
        when: ``before_train`` (default) or ``after_train``.
    """

    def __init__(self, latte: Any = None, loader: Optional[Any] = None, when: str = "before_train") -> None:
        if when not in ("before_train", "after_train"):
            raise ValueError(f"when must be 'before_train' or 'after_train', got {when!r}")
        self.cfg = latte if isinstance(latte, LatteConfig) else LatteConfig.from_dict(dict(latte or {}))
        self.loader = loader
        self.when = when
        self.report: Optional[dict] = None

    def _run(self) -> None:
        loader = self.loader if self.loader is not None else self.trainer.data_loader
        self.report = calibrate_d2_model(self.trainer.model, loader, self.cfg)

    def before_train(self) -> None:
        if self.when == "before_train":
            self._run()

    def after_train(self) -> None:
        if self.when == "after_train":
            self._run()
