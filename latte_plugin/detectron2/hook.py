"""``LinearizeHook``: a detectron2 ``HookBase`` that only decides *when* to calibrate."""
from __future__ import annotations

import os
from typing import Any, Optional

from detectron2.engine import HookBase
from detectron2.utils import comm

from ..adapter import ensure_calibrated
from ..storage import REPORT_NAME, atomic_write_json
from ..calibration.config import LatteConfig
from .calibrate import ADAPTER

__all__ = ["LinearizeHook"]


class LinearizeHook(HookBase):
    """Calibrates LATTE before training from the trainer's train loader, with the same options
    and the same behaviour as mmdet's ``LinearizeHook``: LatteConfig fields as keywords,
    ``calibrate='auto'`` keeps a loaded calibration (its ``mode`` and ``threshold`` applied),
    and a calibration writes ``latte_report.json`` to ``work_dir`` (the main process).

    Args:
        latte: ``LatteConfig`` fields as a dict (or a ``LatteConfig``); merged with ``**settings``.
        loader: a built loader to calibrate on; default ``trainer.data_loader`` (the train split).
        work_dir: where the report goes (e.g. ``cfg.train.output_dir``); ``None``: not written.
        **settings: the other ``LatteConfig`` fields (``candidates``, ``ratio``, ``num_images``,
            ``calibrate='auto'|'always'|'never'``, ...).
    """

    def __init__(self, latte: Any = None, loader: Optional[Any] = None, work_dir: Optional[str] = None,
                 **settings: Any) -> None:
        if isinstance(latte, LatteConfig):
            latte = latte.to_dict()
        self.cfg = LatteConfig.from_dict({**dict(latte or {}), **settings})
        self.loader = loader
        self.work_dir = work_dir
        self.report: Optional[dict] = None

    def before_train(self) -> None:
        data = (lambda: self.loader) if self.loader is not None else (lambda: self.trainer.data_loader)
        report = ensure_calibrated(ADAPTER, self.trainer.model, self.cfg, data)
        if report is not None:
            self.report = report
            if self.work_dir and comm.is_main_process():
                atomic_write_json(report, os.path.join(self.work_dir, REPORT_NAME))
