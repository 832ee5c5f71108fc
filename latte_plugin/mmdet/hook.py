"""``LinearizeHook``: decides *when* to linearize and calibrate inside an mmengine Runner."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional, Sequence

from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmdet.registry import HOOKS

from ..adapter import ensure_calibrated
from ..calibration.config import LatteConfig
from ..storage import REPORT_NAME, atomic_write_json, check_keys, check_latte_candidates, check_readable, checkpoint_state
from .calibrate import ADAPTER, build_calibration_loader, calibrate_detector, install_latte_cores, unwrap

__all__ = ["LinearizeHook"]


@HOOKS.register_module()
class LinearizeHook(Hook):
    """Makes the model a LATTE hybrid before it is validated or tested.

    * ``before_run``: installs LATTE cores in the candidate modules, *before* the Runner
      loads ``load_from`` (so a calibrated checkpoint restores its LATTE state) and before
      ``EMAHook`` (priority 49) copies the model, so the EMA copy has the same structure.
    * first ``before_val_iter`` / ``before_test_iter`` of each loop run: by then
      ``EMAHook.before_*_epoch`` has swapped in the EMA weights. If the model holds no
      calibrated state yet, calibrates on ``num_images`` train images, all-reduces across
      ranks, selects the layers, and writes ``latte_report.json`` to the work dir.

    It also checks the checkpoint the Runner loads (``load_from``): an unreadable file, or
    one whose keys do not match the model's beyond the LATTE buffers, stops the run with one
    line (``allow_partial_load=True`` accepts a partial load).

    Args:
        candidates: module-name patterns of the attention modules that may go linear
            (default: ``LatteConfig``'s, DETR's encoder self-attention).
        calib_pipeline: ``'test'`` (train images through the test pipeline) or ``'train'``.
        calib_batch_size: images per calibration batch.
        allow_partial_load: accept a checkpoint whose keys do not match the model's.
        **latte: the other :class:`~latte_plugin.calibration.config.LatteConfig` fields (``ratio``,
            ``num_linear``, ``variant``, ``num_images``, ``calibrate='auto'|'always'|'never'``, ...).
    """

    priority = "ABOVE_NORMAL"

    def __init__(
        self,
        candidates: Optional[Sequence[str]] = None,
        calib_pipeline: str = "test",
        calib_batch_size: int = 1,
        allow_partial_load: bool = False,
        **latte,
    ) -> None:
        if calib_pipeline not in ("test", "train"):
            raise ValueError(f"calib_pipeline must be 'test' or 'train', got {calib_pipeline!r}")
        if candidates is not None:  # else LatteConfig's default, defined there only
            latte["candidates"] = list(candidates)
        self.latte_cfg = LatteConfig.from_dict(latte)
        self.allow_partial_load = bool(allow_partial_load)
        self.calib_pipeline = calib_pipeline
        self.calib_batch_size = int(calib_batch_size)
        self.report: Optional[dict] = None
        self._pending = False

    @property
    def calibrate(self) -> str:
        return self.latte_cfg.calibrate

    @calibrate.setter
    def calibrate(self, value: str) -> None:
        self.latte_cfg = replace(self.latte_cfg, calibrate=value)

    def before_run(self, runner) -> None:
        names = install_latte_cores(runner.model, self.latte_cfg)
        print_log(f"[latte] {len(names)} candidate attention layer(s): {', '.join(names)}", logger="current")
        if getattr(runner, "_load_from", None):
            check_readable(runner._load_from)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """Refuses a checkpoint that does not fit the model, or a calibrated one made for other
        candidate layers (another model or config)."""
        path = getattr(runner, "_load_from", None) or "the checkpoint"
        model = unwrap(runner.model)
        check_latte_candidates(model.state_dict(), checkpoint_state(checkpoint), path)
        if not self.allow_partial_load:
            check_keys(model, checkpoint, path)

    def before_val_epoch(self, runner) -> None:
        self._pending = True

    def before_test_epoch(self, runner) -> None:
        self._pending = True

    def before_val_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self._pending:
            self._pending = False
            self._ensure_calibrated(runner)

    before_test_iter = before_val_iter

    def _ensure_calibrated(self, runner) -> None:
        self._finish(runner, ensure_calibrated(ADAPTER, runner.model, self.latte_cfg, lambda: self._loader(runner)))

    def run_calibration(self, runner) -> dict:
        """Calibrates now, whatever the model holds (the plain functions do the work), and writes the report."""
        return self._finish(runner, calibrate_detector(runner.model, self._loader(runner), self.latte_cfg))

    def _loader(self, runner):
        return build_calibration_loader(runner.cfg, self.calib_batch_size, self.calib_pipeline, seed=self.latte_cfg.seed,
                                        input_size=self.latte_cfg.input_size)

    def _finish(self, runner, report: Optional[dict]) -> Optional[dict]:
        """After a calibration: keep the report and write it to the work dir (main process)."""
        if report is not None:
            self.report = report
            if is_main_process():
                atomic_write_json(report, os.path.join(runner.work_dir, REPORT_NAME))
        return report

    @staticmethod
    def find(runner) -> Optional["LinearizeHook"]:
        """The runner's LinearizeHook, if any."""
        for h in runner.hooks:
            if isinstance(h, LinearizeHook):
                return h
        return None
