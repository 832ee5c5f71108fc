#!/usr/bin/env python
"""The CPU allocator settings of ``tools/cpu_env.sh`` against glibc's defaults: forward passes of
the embedded detectors on their val images, each setting in fresh processes, side by side.

    python -m benchmarks.allocator [--models cond_detr rtdetr deimv2_vit] [--batch-sizes 1 8]
        [--images 32] [--runs 3] [--json results/allocator_cpu.json]

For each model, batch size and run, one child process per setting (glibc's defaults, then
``source tools/cpu_env.sh``; interleaved, so a slow spell of the machine hits both) builds the
model from its config and checkpoint, runs one warm-up forward and then ``--images`` images
through ``test_step`` (batch 1: what calibration runs; batch 8: what evaluation runs), and
reports seconds per image, its CPU time in the kernel (``getrusage`` ``ru_stime``) and its peak
resident set. The summary is the median over runs and the ratio default / cpu_env (above 1: the
settings are faster). The model's outputs are compared too: the settings change no figure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "cond_detr": ("configs/mmdet/embedded/cond_detr_r18_synthetic.py", "checkpoints/cond_detr_r18_synthetic.pth"),
    "rtdetr": ("configs/mmdet/embedded/rtdetr_r18_synthetic.py", "checkpoints/rtdetr_r18_synthetic.pth"),
    "deimv2_vit": ("configs/mmdet/embedded/deimv2_vit6_synthetic.py", "checkpoints/deimv2_vit6_synthetic.pth"),
}
SETTINGS = ("glibc default", "tools/cpu_env.sh")
ALLOCATOR_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def child(model: str, batch_size: int, images: int) -> dict:
    """Times ``images`` images of ``model``'s val split through ``test_step`` in this process."""
    import torch
    from mmengine.config import Config
    from mmengine.runner import Runner

    import latte_plugin  # noqa: F401  (registers the plugin's modules)

    torch.set_num_threads(2)
    config, checkpoint = MODELS[model]
    cfg = Config.fromfile(os.path.join(ROOT, config))
    cfg.work_dir = os.path.join(ROOT, "work_dirs", "allocator_bench")
    cfg.load_from = os.path.join(ROOT, checkpoint)
    cfg.log_level = "WARNING"
    cfg.val_dataloader.batch_size = batch_size
    runner = Runner.from_cfg(cfg)
    runner.load_or_resume()
    model_ = runner.model.eval()
    loader = iter(Runner.build_dataloader(cfg.val_dataloader))
    batches = [next(loader) for _ in range(1 + max(1, images // batch_size))]
    with torch.no_grad():
        model_.test_step(batches[0])  # warm-up
        start, sys0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
        outs = [model_.test_step(b) for b in batches[1:]]
        seconds = time.perf_counter() - start
        sys_seconds = resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0
    scores = [float(s) for o in outs for p in o for s in p.pred_instances.scores[:5]]
    n = sum(len(b["inputs"]) for b in batches[1:])
    return {"seconds_per_image": seconds / n, "system_seconds_per_image": sys_seconds / n,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "images": n,
            "top_scores": scores}


def run_child(model: str, batch_size: int, images: int, setting: str) -> dict:
    """One fresh process under ``setting``."""
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    cmd = f"{sys.executable} {os.path.abspath(__file__)} --child {model} --batch-sizes {batch_size} --images {images}"
    if setting == "tools/cpu_env.sh":
        cmd = f"source {os.path.join(ROOT, 'tools', 'cpu_env.sh')} && exec {cmd}"
    out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: dict) -> dict:
    """Medians per setting and the ratios default / cpu_env."""
    med = {s: {k: statistics.median(r[k] for r in runs[s])
               for k in ("seconds_per_image", "system_seconds_per_image", "peak_rss_gib")} for s in SETTINGS}
    default, tuned = (med[s] for s in SETTINGS)
    return {"median": med, "speedup": default["seconds_per_image"] / tuned["seconds_per_image"],
            "rss_ratio": tuned["peak_rss_gib"] / default["peak_rss_gib"],
            "same_outputs": all(r["top_scores"] == runs[SETTINGS[0]][0]["top_scores"]
                                for s in SETTINGS for r in runs[s])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--images", type=int, default=32, help="timed images per process")
    p.add_argument("--runs", type=int, default=3, help="processes per setting (the median is reported)")
    p.add_argument("--json", help="write the results here (e.g. results/allocator_cpu.json)")
    p.add_argument("--child", choices=list(MODELS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.batch_sizes[0], a.images)))
        return {}
    rows = []
    for model in a.models:
        for bs in a.batch_sizes:
            runs: dict = {s: [] for s in SETTINGS}
            for _ in range(a.runs):
                for s in SETTINGS:
                    runs[s].append(run_child(model, bs, a.images, s))
            row = {"model": model, "batch_size": bs, **summarise(runs), "runs": runs}
            rows.append(row)
            print(f"{model:11s} batch {bs}: {row['speedup']:.2f}x faster with tools/cpu_env.sh "
                  f"(system time {row['median'][SETTINGS[0]]['system_seconds_per_image']:.3f} -> "
                  f"{row['median'][SETTINGS[1]]['system_seconds_per_image']:.3f} s/image; peak RSS "
                  f"x{row['rss_ratio']:.2f}; same outputs: {row['same_outputs']})", flush=True)
    result = {"command": "python -m benchmarks.allocator " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": list(SETTINGS), "threads": 2, "images": a.images, "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    if a.json:
        from latte_plugin.storage import atomic_write_json

        atomic_write_json(result, a.json)
    return result


if __name__ == "__main__":
    main()
