#!/usr/bin/env python
"""What the defaults cost against the previous defaults: calibration wall time on the embedded
models, the same 32 calibration images, each setting in a fresh process, run one after the other.

    python -m benchmarks.defaults_cost [--num-images 32] [--repeats 1] [--settings ...] [--json results/defaults_cost.json]

Rows: the package defaults, the defaults before ``diag`` joined the correction rules
(``correction_rules=PREVIOUS_CORRECTION_RULES``), the earlier choice rule (``reference='paper'``: the
backward search among the candidates), the previous defaults (greedy + refit, no compensation, a
quarter of the images held out) and ``correction='diag'`` for every configuration. Only the
calibration is timed (no evaluation). With ``--repeats``, the settings take turns (one round of
every setting, then the next round), so that a drift of the machine's speed falls on all alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from latte_plugin.calibration.config import PREVIOUS_CORRECTION_RULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"cond_detr": ("configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py", "checkpoints/cond_detr_r18_synthetic.pth"),
          "rtdetr": ("configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py", "checkpoints/rtdetr_r18_synthetic.pth")}
SETTINGS = {"defaults": {}, "earlier rule": {"reference": "paper"}, "previous defaults": {"selection": "greedy", "correction": "refit", "compensate": "never",
                                                  "holdout": 0.25},
            # the defaults with the diagonal term in every configuration (docs/method.md#diag)
            "defaults, correction='diag'": {"correction": "diag"},
            "defaults before diag joined the rules": {"correction_rules": PREVIOUS_CORRECTION_RULES}}

_CHILD = """
import dataclasses, json, os, sys, time
from latte_plugin.console import quiet
from experiments.main_job import build, parser
from latte_plugin.mmdet.calibrate import calibrate_detector
a = parser().parse_args(["--config", {config!r}, "--checkpoint", {ckpt!r}, "--num-images", "{n}", "--work-dir", {work!r}])
with quiet(os.path.join({work!r}, "log.txt")):
    runner, base, batches = build(a)
    t = time.perf_counter()
    rep = calibrate_detector(runner.model, batches, dataclasses.replace(base, **{changes!r}))
    t = time.perf_counter() - t
print(json.dumps({{"seconds": t, "configuration": rep["selection"].get("configuration")}}))
"""


def measure(model: str, setting: str, num_images: int, work: str) -> dict:
    """One calibration in a fresh process: ``{seconds, configuration}``."""
    config, ckpt = MODELS[model]
    code = _CHILD.format(root=ROOT, config=config, ckpt=ckpt, n=num_images, work=work, changes=SETTINGS[setting])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{model} / {setting} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-images", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="SETTING",
                   help=f"which settings to time (default all: {', '.join(map(repr, SETTINGS))})")
    p.add_argument("--json", help="write the rows here (e.g. results/defaults_cost.json)")
    a = p.parse_args(argv)
    rows = []
    for model in a.models:
        for r in range(a.repeats):
            for setting in a.settings:
                res = measure(model, setting, a.num_images, os.path.join(ROOT, "work_dirs", "defaults_cost"))
                rows.append({"model": model, "setting": setting, "repeat": r, "num_images": a.num_images,
                             "seconds": round(res["seconds"], 1), "configuration": res["configuration"]})
                print(rows[-1], flush=True)
    out = {"rows": rows, "command": "python -m benchmarks.defaults_cost " + shlex.join(argv or sys.argv[1:]),
           "threads": os.environ.get("OMP_NUM_THREADS", "default")}
    if a.json:
        from latte_plugin.storage import atomic_write_json

        atomic_write_json(out, a.json)
    return out


if __name__ == "__main__":
    main()
