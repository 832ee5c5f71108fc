#!/usr/bin/env python
"""Calibrate LATTE on a detector config, write a calibrated checkpoint and a report.

CFG is an mmdet config or a detectron2 LazyConfig (a Python file importing detectron2);
the file decides which framework runs it.

    python tools/calibrate.py CFG [--checkpoint CKPT] [--work-dir DIR] [--eval] [--verbose]
        [--cfg-options k=v ...] [--<any LatteConfig field> VALUE ...]

Every ``LatteConfig`` field is a flag (``--num-images 32``, ``--ratio 0.83 | --num-linear K``,
``--correction none|sigma|refit|diag``, ``--selection``, ``--per-head/--no-per-head``, ...), built
from the dataclass and its fields' metadata: ``--help`` lists them with their defaults.

Writes ``WORK_DIR/latte_calibrated.pth`` (tensors and plain types only: it loads with
``torch.load(weights_only=True)``) and ``WORK_DIR/latte_report.json``. With ``--eval`` it
evaluates the exact and the linearized model with the config's own evaluator (mmdet's
``CocoMetric``, or detectron2's ``COCOEvaluator``) and prints a table. mmdet's ``tools/test.py CFG WORK_DIR/latte_calibrated.pth``
reproduces the linearized numbers without recalibrating.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time



#: LatteConfig fields that are not flags here: this tool always calibrates.
NOT_FLAGS = ("calibrate",)


def add_latte_arguments(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``LatteConfig`` field: type and default from the dataclass, help and
    choices from each field's metadata. Flags left out keep the config's value (``None`` here)."""
    from latte_plugin.calibration.config import LatteConfig

    defaults = LatteConfig()
    g = p.add_argument_group("LATTE settings (LatteConfig fields; unset = the config's value)")
    exclusive = g.add_mutually_exclusive_group()
    for f in dataclasses.fields(LatteConfig):
        if f.name in NOT_FLAGS:
            continue
        default = getattr(defaults, f.name)
        shown = " ".join(map(str, default)) if isinstance(default, (tuple, list)) else default
        # argparse %-formats help strings: a literal percent sign must be doubled
        text = f"{f.metadata.get('help', '')} (default: {shown})".replace("%", "%%")
        kw: dict = dict(dest=f.name, default=None, help=text)
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif "nargs" in f.metadata:  # a number or two (input_size)
            kw.update(nargs=f.metadata["nargs"], type=int, metavar="PIXELS")
        elif isinstance(default, (tuple, list)):
            kw.update(nargs="+", type=type(default[0]) if default else str, metavar=f.name.upper())
        else:
            kw["type"] = (float if "float" in str(f.type) else str if "str" in str(f.type) else int) if default is None else type(default)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        target = exclusive if f.name in ("ratio", "num_linear") else g
        target.add_argument("--" + f.name.replace("_", "-"), **kw)


def latte_overrides(args: argparse.Namespace) -> dict:
    """The ``LatteConfig`` fields given on the command line."""
    from latte_plugin.calibration.config import LatteConfig

    o = {f.name: getattr(args, f.name) for f in dataclasses.fields(LatteConfig)
         if f.name not in NOT_FLAGS and getattr(args, f.name, None) is not None}
    if "ratio" in o:
        o["num_linear"] = None
    return o


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="LATTE training-free calibration")
    p.add_argument("config", help="an mmdet config (.py) that imports latte_plugin.mmdet, or a detectron2 LazyConfig")
    p.add_argument("--checkpoint", help="pretrained checkpoint (default: the config's load_from, or the init weights)")
    p.add_argument("--allow-partial-load", action="store_true",
                   help="accept a checkpoint whose keys do not match the model's (default: refuse it)")
    p.add_argument("--work-dir", help="where the calibrated checkpoint and report go")
    p.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none",
                   help="mmengine launcher for distributed calibration (e.g. under torchrun: pytorch)")
    p.add_argument("--eval", action="store_true", help="evaluate exact and linearized models with the config's evaluator")
    p.add_argument("--verbose", action="store_true", help="print the frameworks' full logs (default: to a log file)")
    p.add_argument("--cfg-options", nargs="+", default=[],
                   help="key=value config overrides (mmengine style, or detectron2 dotted LazyConfig overrides)")
    add_latte_arguments(p)
    return p.parse_args(argv)


def format_table(rows: list[dict]) -> str:
    """The results table: variant, layers linear, bbox mAP, mAP@.5, % kept, attention GFLOPs."""
    head = f"{'variant':10s} {'linear':>7s} {'bbox_mAP':>9s} {'mAP@.5':>7s} {'% kept':>7s} {'attn GFLOPs':>12s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['variant']:10s} {r['linear']:>7s} {r['bbox_mAP']:9.4f} {r['bbox_mAP_50']:7.4f} "
                     f"{r['kept']:7.1f} {r['gflops']:12.4f}")
    return "\n".join(lines)


_RELATIVE_IMPORT = re.compile(r"^from\s+\.([\w.]*)\s+import", re.MULTILINE)


def config_framework(path: str, _depth: int = 0) -> str:
    """``'detectron2'`` for a detectron2 LazyConfig: a Python file that imports detectron2 or
    ``latte_plugin.detectron2``, or imports (``from .base import ...``) a file that does.
    Anything else is taken as an mmdet config (``'mmdet'``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if re.search(r"^\s*(from|import)\s+(detectron2|latte_plugin\.detectron2)\b", text, re.MULTILINE):
        return "detectron2"
    if _depth < 8:
        for mod in _RELATIVE_IMPORT.findall(text):
            base = os.path.join(os.path.dirname(path), *mod.split(".")) + ".py"
            if mod and os.path.exists(base) and config_framework(base, _depth + 1) == "detectron2":
                return "detectron2"
    return "mmdet"


def run(args: argparse.Namespace) -> dict:
    """Calibrates (and evaluates) with the framework the config file belongs to."""
    common = dict(checkpoint=args.checkpoint, work_dir=args.work_dir, overrides=latte_overrides(args),
                  evaluate=args.eval, allow_partial_load=args.allow_partial_load)
    if config_framework(args.config) == "detectron2":
        try:
            from latte_plugin.detectron2.workflow import run_calibration as run_d2
        except ModuleNotFoundError as e:
            raise SystemExit(f"{args.config} is a detectron2 LazyConfig but detectron2 is not importable ({e}); "
                             "install it from its official source (README, 'The two commands')") from e
        return run_d2(args.config, opts=args.cfg_options, **common)
    from latte_plugin.mmdet.workflow import run_calibration

    return run_calibration(args.config, opts=args.cfg_options, launcher=args.launcher, **common)


def _close_process_group() -> None:
    """Under a launcher: wait for every rank, then close the process group (a gloo group left
    open at interpreter exit can abort a rank with 'terminate called without an active exception')."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    from latte_plugin.console import quiet, say
    from latte_plugin.calibration.config import LatteConfig
    from latte_plugin.storage import CheckpointError

    args.work_dir = args.work_dir or os.path.join("work_dirs", os.path.splitext(os.path.basename(args.config))[0])
    log_path = os.path.join(args.work_dir, "calibrate.log")
    try:
        LatteConfig.from_dict(latte_overrides(args))  # a bad setting: one line, before anything is built
        if not os.path.isfile(args.config):
            raise SystemExit(f"error: {args.config}: no such config file; give the path of an mmdet config or a "
                             "detectron2 LazyConfig (e.g. configs/mmdet/detr_r50_latte_coco.py)")
        with quiet(log_path, enabled=not args.verbose):
            report = run(args)
    except (CheckpointError, ValueError, FileNotFoundError) as e:  # one line that names the file or setting and says what to do
        if args.verbose and not isinstance(e, CheckpointError):
            raise  # the whole traceback, for a report
        raise SystemExit(f"error: {e}") from None
    finally:
        _close_process_group()
    if args.eval:
        m, g = report["metrics"], report["attention_gflops"]
        n_lin = f"{len(report['linearized'])}/{len(report['candidates'])}"
        rows = [
            dict(variant="exact", linear=f"0/{len(report['candidates'])}", kept=100.0, gflops=g["exact"], **m["exact"]),
            dict(variant=report["variant"], linear=n_lin, kept=100.0 * report["retained"], gflops=g["linearized"],
                 **m["linearized"]),
        ]
        say(format_table(rows))
    say(f"report: {report['paths']['report']}\ncheckpoint: {report['paths']['checkpoint']}\n"
        + ("" if args.verbose else f"log: {log_path}\n") + f"({time.time() - t0:.1f} s)")
    return report


if __name__ == "__main__":
    main()
