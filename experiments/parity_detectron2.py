#!/usr/bin/env python
"""mmdet's CocoMetric vs detectron2's COCOEvaluator on the same checkpoints, through each
framework's own evaluation script; writes ``results/parity_detectron2.json``.

    python experiments/parity_detectron2.py [--models cond_detr rtdetr] [--detectron2-src SRC]
        [--out results/parity_detectron2.json] [--work-dir work_dirs/parity]

For each embedded model: ``tools/calibrate.py`` (defaults) on its mmdet config, then mmdet's
``tools/test.py`` and detectron2's ``tools/lazyconfig_train_net.py --eval-only`` on the
exact checkpoint and on the calibrated one. SRC is the detectron2 source (a checkout or the
source archive, default ``$LATTE_DETECTRON2_SRC``): its ``tools/lazyconfig_train_net.py``
is the script run. Needs the generated data in ``data/synthetic`` (``bash tools/demo.sh``
or ``python -m latte_plugin.data.synthetic data/synthetic --train 4000 --val 300``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from latte_plugin.console import first_paragraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "cond_detr": dict(name="Conditional DETR", mmdet="configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py",
                      d2="configs/detectron2/embedded/cond_detr_r18_synthetic_latte.py",
                      checkpoint="checkpoints/cond_detr_r18_synthetic.pth"),
    "rtdetr": dict(name="RT-DETR", mmdet="configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py",
                   d2="configs/detectron2/embedded/rtdetr_r18_synthetic_latte.py",
                   checkpoint="checkpoints/rtdetr_r18_synthetic.pth"),
}


def d2_script(src: str, into: str) -> str:
    """detectron2's ``tools/lazyconfig_train_net.py`` from a checkout or a source archive."""
    if os.path.isdir(src):
        return os.path.join(src, "tools", "lazyconfig_train_net.py")
    with tarfile.open(src) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("tools/lazyconfig_train_net.py"))
        tar.extract(member, into, filter="data")
        return os.path.join(into, member.name)


def run(cmd: list[str], log: str) -> str:
    """Runs ``cmd`` (output to ``log``); returns the output. Raises with the log's tail on failure."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (log: {log}):\n{(res.stdout + res.stderr)[-2000:]}")
    return res.stdout + res.stderr


def mmdet_map(cfg: str, ckpt: str, work: str) -> float:
    import mmdet

    test = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "tools", "test.py")
    out = run([sys.executable, test, cfg, ckpt, "--work-dir", work], work + ".log")
    return float(re.findall(r"coco/bbox_mAP: ([0-9.]+)", out)[-1])


def d2_ap(script: str, cfg: str, ckpt: str, work: str, latte: bool) -> float:
    never = ["model.latte.calibrate=never"] if latte else []  # a calibrated checkpoint is used as is
    out = run([sys.executable, script, "--eval-only", "--config-file", cfg, f"train.init_checkpoint={ckpt}",
               f"train.output_dir={work}", *never], work + ".log")
    return float(re.findall(r"copypaste: ([0-9.na]+),", out)[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--detectron2-src", default=os.environ.get("LATTE_DETECTRON2_SRC"))
    p.add_argument("--out", default="results/parity_detectron2.json")
    p.add_argument("--work-dir", default="work_dirs/parity")
    a = p.parse_args(argv)
    if not a.detectron2_src:
        raise SystemExit("give --detectron2-src (a detectron2 checkout or source archive) or set LATTE_DETECTRON2_SRC")
    from latte_plugin.console import say
    from latte_plugin.storage import atomic_write_json

    os.makedirs(a.work_dir, exist_ok=True)
    script = d2_script(a.detectron2_src, tempfile.mkdtemp())
    rows = []
    for key in a.models:
        m = MODELS[key]
        work = os.path.join(a.work_dir, key)
        run([sys.executable, "tools/calibrate.py", m["mmdet"], "--checkpoint", m["checkpoint"], "--work-dir", work],
            work + "_calibrate.log")
        calibrated = os.path.join(work, "latte_calibrated.pth")
        for state, ckpt in (("exact", m["checkpoint"]), ("calibrated (tools/calibrate.py defaults)", calibrated)):
            cfg_m = m["mmdet"].replace("_latte.py", ".py") if state == "exact" else m["mmdet"]
            cfg_d = m["d2"].replace("_latte.py", ".py") if state == "exact" else m["d2"]
            tag = os.path.join(work, "exact" if state == "exact" else "latte")
            row = dict(model=m["name"], checkpoint=ckpt if state == "exact" else f"{m['checkpoint']} -> calibrated",
                       state=state, mmdet_bbox_mAP=mmdet_map(cfg_m, ckpt, tag + "_mmdet"),
                       detectron2_AP=d2_ap(script, cfg_d, ckpt, tag + "_d2", state != "exact"))
            rows.append(row)
            say(f"[parity] {row['model']:16s} {state:42s} mmdet {row['mmdet_bbox_mAP']:.3f}  "
                f"detectron2 {row['detectron2_AP']:.2f}")
    commit = "02b5c4e295e990042a714712c21dc79b731e8833"
    out = {"rows": rows, "detectron2_commit": commit, "command": "python experiments/parity_detectron2.py"}
    atomic_write_json(out, a.out)
    say(f"results: {a.out}")
    return out


if __name__ == "__main__":
    main()
