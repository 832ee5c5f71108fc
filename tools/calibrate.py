#!/usr/bin/env python
"""Calibrate LATTE on a detector config, write a calibrated checkpoint and a report.

CFG is an mmdet config or a detectron2 LazyConfig (a Python file importing detectron2);
the file decides which framework runs it.

    python tools/calibrate.py CFG [--checkpoint CKPT] [--work-dir DIR] [--num-images 64]
        [--ratio 0.67 | --num-linear K] [--variant latte] [--sequential] [--selection score]
        [--eval] [--cfg-options k=v ...]

Writes ``WORK_DIR/latte_calibrated.pth`` (tensors and plain types only: it loads with
``torch.load(weights_only=True)``) and ``WORK_DIR/latte_report.json``. With ``--eval`` it
evaluates the exact and the linearized model with the config's own evaluator (mmdet's
``CocoMetric``, or detectron2's ``COCOEvaluator``) and prints a table. mmdet's ``tools/test.py CFG WORK_DIR/latte_calibrated.pth``
reproduces the linearized numbers without recalibrating.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPORT_NAME = "latte_report.json"
CKPT_NAME = "latte_calibrated.pth"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="LATTE training-free calibration")
    p.add_argument("config", help="an mmdet config (.py) that imports latte_plugin.mmdet, or a detectron2 LazyConfig")
    p.add_argument("--checkpoint", help="pretrained checkpoint (default: the config's load_from, or the init weights)")
    p.add_argument("--work-dir", help="where the calibrated checkpoint and report go")
    p.add_argument("--num-images", type=int, help="calibration images from the train split (default 64)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ratio", type=float, help="fraction of candidate layers made linear (default 0.67)")
    g.add_argument("--num-linear", type=int, help="number of candidate layers made linear")
    p.add_argument("--variant", choices=["qtvit", "jpn_only", "tte_only", "latte"])
    p.add_argument("--sequential", action="store_true", help="sequential calibration (spec 6.3)")
    p.add_argument("--selection", choices=["score", "greedy", "backward"])
    p.add_argument("--refit", action="store_true", help="ridge refit of the output instead of sigma (beyond the paper)")
    p.add_argument("--holdout", type=float, help="fraction of calibration images held out to choose the knobs")
    p.add_argument("--no-sigma", action="store_true", help="do not fit the output rescaling sigma")
    p.add_argument("--per-head", action="store_true", help="fit (alpha, rho) per head (beyond the paper)")
    p.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none",
                   help="mmengine launcher for distributed calibration (e.g. under torchrun: pytorch)")
    p.add_argument("--eval", action="store_true", help="evaluate exact and linearized models with the config's evaluator")
    p.add_argument("--cfg-options", nargs="+", default=[],
                   help="key=value config overrides (mmengine style, or detectron2 dotted LazyConfig overrides)")
    return p.parse_args(argv)


def _overrides(args: argparse.Namespace) -> dict:
    o = {}
    if args.num_images is not None:
        o["num_images"] = args.num_images
    if args.ratio is not None:
        o["ratio"], o["num_linear"] = args.ratio, None
    if args.num_linear is not None:
        o["num_linear"] = args.num_linear
    if args.variant:
        o["variant"] = args.variant
    if args.sequential:
        o["sequential"] = True
    if args.selection:
        o["selection"] = args.selection
    if args.no_sigma:
        o["fit_sigma"] = False
    if args.per_head:
        o["per_head"] = True
    if args.refit:
        o["refit"] = True
    if args.holdout is not None:
        o["holdout"] = args.holdout
    return o


def format_table(rows: list[dict]) -> str:
    """The results table: variant, layers linear, bbox mAP, mAP@.5, % kept, attention GFLOPs."""
    head = f"{'variant':10s} {'linear':>7s} {'bbox_mAP':>9s} {'mAP@.5':>7s} {'% kept':>7s} {'attn GFLOPs':>12s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['variant']:10s} {r['linear']:>7s} {r['bbox_mAP']:9.4f} {r['bbox_mAP_50']:7.4f} "
                     f"{r['kept']:7.1f} {r['gflops']:12.4f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    from latte_plugin.configs import config_framework

    if config_framework(args.config) == "detectron2":
        try:
            from latte_plugin.detectron2.tools import run_calibration_d2
        except ImportError as e:
            raise SystemExit(f"{args.config} is a detectron2 LazyConfig but detectron2 is not importable ({e}); "
                             "install it from its official source (README, 'Detectron2')") from e

        report = run_calibration_d2(args.config, checkpoint=args.checkpoint, work_dir=args.work_dir,
                                    overrides=_overrides(args), evaluate=args.eval, opts=args.cfg_options)
    else:
        from latte_plugin.mmdet.tools import run_calibration

        report = run_calibration(args.config, checkpoint=args.checkpoint, work_dir=args.work_dir,
                                 overrides=_overrides(args), evaluate=args.eval, cfg_options=args.cfg_options,
                                 launcher=args.launcher)
    if args.eval:
        m, g = report["metrics"], report["attention_gflops"]
        n_lin = f"{len(report['linearized'])}/{len(report['candidates'])}"
        rows = [
            dict(variant="exact", linear=f"0/{len(report['candidates'])}", kept=100.0, gflops=g["exact"], **m["exact"]),
            dict(variant=report["variant"], linear=n_lin, kept=100.0 * report["retained"], gflops=g["linearized"],
                 **m["linearized"]),
        ]
        print(format_table(rows))
    print(f"report: {report['paths']['report']}\ncheckpoint: {report['paths']['checkpoint']}\n"
          f"({time.time() - t0:.1f} s)")
    return report


if __name__ == "__main__":
    main()
