"""What ``tools/calibrate.py`` does for an mmdet config, as a function (tests call it too):
build the config's Runner, calibrate through its :class:`LinearizeHook`, write the artifacts."""
from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..artifacts import write_artifacts
from ..nn.install import find_latte_layers, set_modes
from ..storage import check_checkpoint, check_readable, save_calibrated_checkpoint as save_bare
from .calibrate import inner_dataset, install_latte_cores, resize_pipeline, unwrap

if TYPE_CHECKING:
    from ..calibration.config import LatteConfig

__all__ = ["run_calibration", "evaluate_bbox", "save_calibrated_checkpoint", "load_config", "set_linearize_hook",
           "hook_latte_settings", "drop_linearize_hook", "runner_with_checkpoint"]


def _bbox(metrics: dict) -> dict:
    def get(key: str) -> float:
        for k, v in metrics.items():
            if k.endswith(key):
                return float(v)
        raise KeyError(f"the evaluator reported no '{key}' (got {sorted(metrics)}); is it mmdet's CocoMetric?")

    return {"bbox_mAP": get("bbox_mAP"), "bbox_mAP_50": get("bbox_mAP_50")}


def evaluate_bbox(runner, linear: Sequence[str], mode: str = "linear") -> dict:
    """Runs the Runner's own test loop (its evaluator) with ``linear`` layers in ``mode``, the rest exact."""
    layers = find_latte_layers(unwrap(runner.model))
    set_modes(layers, linear, mode)
    return _bbox(runner.test())


def save_calibrated_checkpoint(model: torch.nn.Module, report: dict, path: str) -> None:
    """:func:`latte_plugin.storage.save_calibrated_checkpoint` of the model inside mmengine's wrappers."""
    save_bare(unwrap(model), report, path)


def unformatted(cfg):
    """``cfg`` with mmengine's yapf pass over its text switched off, in place (``format_python_code``).

    The Runner prints and dumps the config's text several times; yapf takes 2-3 s each time on
    a detector config, the same config either way. mmengine 0.10.7's ``Config.fromfile`` drops its
    own ``format_python_code=False`` for pure-Python configs, so the flag is set on the object.
    """
    object.__setattr__(cfg, "_format_python_code", False)
    return cfg


def load_config(config: str, cfg_options: Sequence[str] = ()):
    """``Config.fromfile`` with ``--cfg-options key=value`` pairs merged as mmdet's tools do."""
    from mmengine.config import Config, DictAction

    cfg = unformatted(Config.fromfile(config))
    action = DictAction(option_strings=[], dest="x")
    opts = {k: action._parse_iterable(v) for k, v in (kv.split("=", 1) for kv in cfg_options)}
    if opts:
        cfg.merge_from_dict(opts)
    return cfg


def _hook_index(cfg, config: str) -> int:
    from .hook import LinearizeHook

    hooks = list(cfg.get("custom_hooks", []) or [])
    idx = [i for i, h in enumerate(hooks) if h.get("type") in ("LinearizeHook", LinearizeHook)]
    if not idx:
        raise ValueError(f"{config} has no LinearizeHook in custom_hooks; inherit a latte config or add one")
    return idx[0]


def set_linearize_hook(cfg, config: str, **changes) -> dict:
    """Updates the config's ``LinearizeHook`` entry with ``changes``; returns the entry.

    Raises:
        ValueError: the config has no ``LinearizeHook`` (one line naming ``config``).
    """
    hooks = list(cfg.get("custom_hooks", []) or [])
    i = _hook_index(cfg, config)
    hooks[i] = dict(copy.deepcopy(hooks[i]), **changes)
    cfg.custom_hooks = hooks
    return hooks[i]


def hook_latte_settings(cfg, config: str) -> "LatteConfig":
    """The ``LatteConfig`` of the config's ``LinearizeHook`` entry (its other options left out)."""
    from ..calibration.config import LatteConfig

    entry = dict(cfg.custom_hooks[_hook_index(cfg, config)])
    return LatteConfig.from_dict({k: v for k, v in entry.items() if k in LatteConfig.__dataclass_fields__})


def drop_linearize_hook(cfg) -> None:
    """Removes the ``LinearizeHook`` (for jobs that drive LATTE themselves, or the exact model)."""
    cfg.custom_hooks = [h for h in cfg.get("custom_hooks", []) or [] if h.get("type") != "LinearizeHook"]


def _no_persistent_test_workers(cfg) -> None:
    """The evaluation loaders without persistent workers. The tools' Runner runs each test loop once;
    persistent workers outlive it and, when the Runner is collected inside a Python process (a
    caller of ``run_calibration``, the test suite), their shutdown waits 5 s per worker for an exit
    that never comes: 10.0 s of a 14 s YOLOS calibration with ``--eval`` (measured; without
    persistence the workers stop at the end of each loop, 0.3 s)."""
    for key in ("val_dataloader", "test_dataloader"):
        if cfg.get(key) is not None and cfg[key].get("persistent_workers"):
            cfg[key].persistent_workers = False


def runner_with_checkpoint(cfg, checkpoint: Optional[str], latte: Optional["LatteConfig"] = None):
    """Builds the config's Runner, installs the LATTE cores (through its ``LinearizeHook``, or
    ``latte``'s candidates when the hook was dropped), and loads ``checkpoint``, checked once
    against the model (keys and shapes): by the hook when there is one (which honours its
    ``allow_partial_load``), else here.

    Raises:
        CheckpointError: an unreadable checkpoint, or one that does not fit (one line).
    """
    from mmengine.runner import Runner

    from .hook import LinearizeHook

    cfg.load_from = checkpoint or cfg.get("load_from")
    _no_persistent_test_workers(cfg)
    runner = Runner.from_cfg(cfg)
    hook = LinearizeHook.find(runner)
    if hook is not None:
        hook.before_run(runner)  # LATTE layers in place before the checkpoint restores their state
    elif latte is not None:
        install_latte_cores(runner.model, latte)
    if cfg.load_from and hook is None:  # with the hook, its after_load_checkpoint checks (keys and shapes)
        check_checkpoint(unwrap(runner.model), cfg.load_from, "a checkpoint of this config")
    runner.load_or_resume()
    return runner


def _launcher(launcher: str) -> str:
    """mmengine's ``init_dist`` calls ``torch.cuda.set_device``; on CPU-only machines start gloo
    from torchrun's environment ourselves (mmengine's dist utilities and samplers use it)."""
    if launcher == "pytorch" and not torch.cuda.is_available():
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return "none"
    return launcher


def run_calibration(config: str, checkpoint: Optional[str] = None, work_dir: Optional[str] = None,
                    overrides: Optional[dict] = None, evaluate: bool = False, opts: Sequence[str] = (),
                    allow_partial_load: bool = False, launcher: str = "none") -> dict:
    """Builds the config's Runner, calibrates through its :class:`LinearizeHook`, saves, and evaluates.

    Returns:
        The report (also written to ``WORK_DIR/latte_report.json``) with ``metrics``,
        ``retained`` and ``paths`` when evaluated.
    """
    from mmengine.dist import is_main_process

    from .hook import LinearizeHook

    cfg = load_config(config, opts)
    set_linearize_hook(cfg, config, **(overrides or {}), calibrate="always", allow_partial_load=bool(allow_partial_load))
    size = hook_latte_settings(cfg, config).input_size
    if size is not None:  # evaluated where it is deployed (the calibration loader resizes itself)
        for key in ("val_dataloader", "test_dataloader"):
            if cfg.get(key) is not None:
                resize_pipeline(inner_dataset(cfg[key]["dataset"])["pipeline"], size, f"{config}'s {key}")
    cfg.work_dir = work_dir or cfg.get("work_dir") or os.path.join(
        "work_dirs", os.path.splitext(os.path.basename(config))[0])
    if checkpoint:
        check_readable(checkpoint)
    cfg.launcher = _launcher(launcher)
    runner = runner_with_checkpoint(cfg, checkpoint)
    hook = LinearizeHook.find(runner)
    report = hook.run_calibration(runner)
    hook.calibrate = "never"  # later test() calls reuse this state
    mode = hook.latte_cfg.mode
    return write_artifacts(unwrap(runner.model), report, runner.work_dir, "mmdet",
                           (lambda linear: evaluate_bbox(runner, linear, mode)) if evaluate else None,
                           is_main_process())
