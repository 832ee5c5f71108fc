"""``LinearizeHook``: decides *when* to linearize and calibrate inside an mmengine Runner."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmdet.registry import HOOKS

from ..core.flow import LatteConfig, find_latte_layers
from ..core.io import atomic_write_json
from .calibrate import (build_calibration_loader, calibrate_detector, calibration_batches,
                        latte_layers_calibrated, linearize_model, unwrap)

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

    Args:
        candidates: module-name patterns of the attention modules that may go linear.
        calibrate: ``'auto'`` (only if the checkpoint has no LATTE state), ``'always'``, or
            ``'never'`` (error if the checkpoint has none).
        calib_pipeline: ``'test'`` (train images through the test pipeline) or ``'train'``.
        calib_batch_size: images per calibration batch.
        **latte: the other :class:`~latte_plugin.core.flow.LatteConfig` fields
            (``ratio``, ``num_linear``, ``variant``, ``num_images``, ``sequential``, ...).
    """

    priority = "ABOVE_NORMAL"

    def __init__(
        self,
        candidates: Sequence[str] = ("encoder.layers.*.self_attn",),
        calibrate: str = "auto",
        calib_pipeline: str = "test",
        calib_batch_size: int = 1,
        **latte,
    ) -> None:
        if calibrate not in ("auto", "always", "never"):
            raise ValueError(f"calibrate must be 'auto', 'always' or 'never', got {calibrate!r}")
        if calib_pipeline not in ("test", "train"):
            raise ValueError(f"calib_pipeline must be 'test' or 'train', got {calib_pipeline!r}")
        self.latte_cfg = LatteConfig.from_dict(dict(candidates=list(candidates), **latte))
        self.calibrate = calibrate
        self.calib_pipeline = calib_pipeline
        self.calib_batch_size = int(calib_batch_size)
        self.report: Optional[dict] = None
        self._pending = False

    def before_run(self, runner) -> None:
        names = linearize_model(runner.model, self.latte_cfg)
        print_log(f"[latte] {len(names)} candidate attention layer(s): {', '.join(names)}", logger="current")

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        """Refuses a calibrated checkpoint made for other candidate layers (another model or config)."""
        meta = (checkpoint.get("meta") or {}).get("latte") if isinstance(checkpoint, dict) else None
        if not meta:
            return
        ours = list(find_latte_layers(unwrap(runner.model)))
        theirs = list(meta.get("candidates", []))
        if theirs != ours:
            raise ValueError(
                f"the checkpoint was calibrated for LATTE candidates {theirs}, but this config's "
                f"candidates are {ours}: it comes from another model or config; re-run tools/calibrate.py"
            )

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
        linearize_model(runner.model, self.latte_cfg)
        state = latte_layers_calibrated(runner.model)
        if state is None:
            raise ValueError(
                "the checkpoint holds LATTE state for some candidate layers but not others; "
                "it was calibrated with other candidates; re-run tools/calibrate.py for this config"
            )
        if state and self.calibrate != "always":
            print_log("[latte] using the calibrated LATTE state loaded from the checkpoint", logger="current")
            return
        if not state and self.calibrate == "never":
            raise ValueError(
                "calibrate='never' but the loaded checkpoint has no LATTE state; pass a checkpoint "
                "written by tools/calibrate.py, or set LinearizeHook(calibrate='auto')"
            )
        self.run_calibration(runner)

    def run_calibration(self, runner) -> dict:
        """Calibrates now (the plain functions do the work) and writes the report."""
        loader = build_calibration_loader(
            runner.cfg, self.calib_batch_size, self.calib_pipeline, seed=self.latte_cfg.seed
        )
        batches = calibration_batches(loader, self.latte_cfg.num_images, self.calib_batch_size)
        self.report = calibrate_detector(runner.model, batches, self.latte_cfg)
        if is_main_process():
            atomic_write_json(self.report, os.path.join(runner.work_dir, "latte_report.json"))
        return self.report

    @staticmethod
    def find(runner) -> Optional["LinearizeHook"]:
        """The runner's LinearizeHook, if any."""
        for h in runner.hooks:
            if isinstance(h, LinearizeHook):
                return h
        return None
