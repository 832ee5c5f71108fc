#!/usr/bin/env python
"""Calibration cost at real size: wall time and peak memory of ``tools/calibrate.py`` on the COCO
configs (random weights: cost does not depend on them), each in a fresh process.

    python -m benchmarks.calibration_cost [--num-images 64] [--models detr rtdetr] \
        [--json results/calibration_cost.json]

DETR-R50: ``configs/mmdet/detr_r50_latte_coco.py`` on generated 800x1333 images (the test
pipeline keeps them at 800x1333: 25x42 = 1050 encoder tokens). RT-DETR-R50vd:
``configs/mmdet/rtdetr_r50vd_latte_coco.py`` with an HF R50vd directory, at 640x640.
DEIMv2-S and D-FINE-S: their ``configs/mmdet/hf_*_latte_coco.py`` with a ``save_pretrained``
directory of the architecture (``latte_plugin/resources/architectures``), at 640x640 (DEIMv2-S: 1,600 ViT tokens).
Peak memory is the child process's peak resident set size (``getrusage`` ``ru_maxrss``).
Rows of models not run this time are kept from ``--json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "detr": dict(name="DETR-R50", config="detr_r50_latte_coco.py", size=(800, 1333), input="800x1333"),
    "rtdetr": dict(name="RT-DETR-R50vd", config="rtdetr_r50vd_latte_coco.py", size=(640, 640), input="640x640"),
    "deimv2": dict(name="DEIMv2-S", config="hf_deimv2_dinov3_s_latte_coco.py", size=(640, 640), input="640x640",
                   family="deimv2"),
    "dfine": dict(name="D-FINE-S", config="hf_d_fine_s_latte_coco.py", size=(640, 640), input="640x640",
                  family="d_fine"),
}


def prepare(key: str, root: str, work: str, num_images: int) -> list[str]:
    """Data, weights and the config for one model; returns the calibrate.py command."""
    import torch
    from mmengine.config import Config

    from latte_plugin.data.synthetic import make_coco_layout

    m = MODELS[key]
    h, w = m["size"]
    data = make_coco_layout(os.path.join(root, f"coco_{h}x{w}"), num_train=num_images, num_val=1, size=h, width=w)
    cfg = Config.fromfile(os.path.join(ROOT, "configs", "mmdet", m["config"]))
    for k in ("train_dataloader", "val_dataloader", "test_dataloader"):
        cfg[k].dataset.data_root = data + "/"
    for k in ("val_evaluator", "test_evaluator"):
        cfg[k].ann_file = data + "/annotations/instances_val2017.json"
    extra = []
    if key == "detr":
        from mmdet.registry import MODELS as REG
        from mmdet.utils import register_all_modules

        register_all_modules()
        cfg.model.backbone.init_cfg = None
        ckpt = os.path.join(root, "detr_r50.pth")
        torch.save({"meta": {}, "state_dict": REG.build(copy.deepcopy(cfg.model)).state_dict()}, ckpt)
        extra = ["--checkpoint", ckpt]
    elif "family" in m:
        from latte_plugin.hf.detectors import FAMILIES, build_detector

        hf_dir = os.path.join(root, key)
        torch.manual_seed(0)
        build_detector(m["family"], FAMILIES[m["family"]].architecture).save_pretrained(hf_dir)
        extra = ["--cfg-options", f"model.pretrained={hf_dir}"]
    else:
        from latte_plugin.cli.convert_rtdetr_original import build_config
        from transformers import RTDetrForObjectDetection

        hf_dir = os.path.join(root, "rtdetr_r50vd")
        RTDetrForObjectDetection(build_config("r50vd")).save_pretrained(hf_dir)
        extra = ["--cfg-options", f"model.pretrained={hf_dir}"]
    path = os.path.join(root, m["config"])
    cfg.dump(path)
    return [sys.executable, os.path.join(ROOT, "tools", "calibrate.py"), path, "--work-dir", work,
            "--num-images", str(num_images), *extra]


def measure(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of a fresh child process. This parent never imports torch,
    so the child starts small and its ``ru_maxrss`` is its own peak."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode})")
    return time.time() - t0, usage.ru_maxrss / 2**20  # KiB -> GiB


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=64)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--json", default="results/calibration_cost.json")
    p.add_argument("--prepare", nargs=3, metavar=("MODEL", "ROOT", "WORK"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.prepare:  # in its own process: prints the command to measure
        print(json.dumps(prepare(a.prepare[0], a.prepare[1], a.prepare[2], a.num_images)))
        return {}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for key in a.models:
            work = os.path.join(root, f"work_{key}")
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--num-images", str(a.num_images),
                                  "--prepare", key, root, work], capture_output=True, text=True, check=True, cwd=ROOT)
            cmd = json.loads(out.stdout.strip().splitlines()[-1])
            seconds, gib = measure(cmd)
            rows.append(dict(model=MODELS[key]["name"], input=MODELS[key]["input"], num_images=a.num_images,
                             seconds=round(seconds, 1), peak_rss_gib=round(gib, 2), threads=os.cpu_count(),
                             command=f"python -m benchmarks.calibration_cost --num-images {a.num_images} "
                                     f"--models {key}"))
            print(f"{rows[-1]['model']:14s} {rows[-1]['input']:9s} {a.num_images} images: {seconds / 60:.1f} min, "
                  f"peak RSS {gib:.2f} GiB", flush=True)
    ran = {r["model"] for r in rows}
    kept = [r for r in _previous_rows(a.json) if r["model"] not in ran]
    out = {"rows": kept + rows, "machine": f"{os.cpu_count()} CPU cores"}
    from latte_plugin.storage import atomic_write_json

    atomic_write_json(out, a.json)
    return out


def _previous_rows(path: str) -> list[dict]:
    """The rows already in ``path`` (each with the command that made it), or none."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    return [dict(r, command=r.get("command", old.get("command", ""))) for r in old.get("rows", [])]


if __name__ == "__main__":
    main()
