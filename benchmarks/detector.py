#!/usr/bin/env python
"""Exact vs LATTE-linearized DETR-R50 (mmdet shapes, random weights): encoder and end-to-end latency.

    python -m benchmarks.detector [--sizes 800x1333 1600x2666] [--reps 3] [--json out.json]

Random weights are fine for timing. 4 of the 6 encoder self-attention layers (67%) are
made linear, as in the paper's protocol, or all 6 with ``--num-linear 6``. Also prints the
attention-core FLOPs next to the paper's 15x at T = 1000.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch



def detr_r50_with_latte():
    """mmdet's DETR-R50 (random weights, fine for timing) with LATTE installed in its 6 encoder
    self-attention layers and calibrated-like scalars: ``(model, layer names, layers)``."""
    import mmdet
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    from latte_plugin.calibration.config import LatteConfig

    from latte_plugin.nn.install import find_latte_layers
    from latte_plugin.mmdet import install_latte_cores

    register_all_modules()
    cfg = Config.fromfile(os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", "detr",
                                       "detr_r50_8xb2-150e_coco.py"))
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
    model = MODELS.build(cfg.model).eval()
    names = install_latte_cores(model, LatteConfig(candidates=["encoder.layers.*.self_attn"]))
    layers = find_latte_layers(model)
    for lay in layers.values():
        lay.m.fill_(0.7)
        lay.log_rho.fill_(1.0)
    return model, names, layers


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["800x1333", "1600x2666"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-linear", type=int, default=4)
    p.add_argument("--json")
    a = p.parse_args(argv)

    from mmdet.structures import DetDataSample

    from latte_plugin.ops.flops import layer_flops
    from latte_plugin.nn.install import set_modes
    from experiments.main_job_rows import encoder_latency

    model, names, layers = detr_r50_with_latte()
    rows = []
    print(f"threads={torch.get_num_threads()}  DETR-R50 (d=256, 8 heads), {a.num_linear}/6 encoder layers linear")
    print(f"{'input':>10s} {'tokens':>6s} {'enc exact s':>11s} {'enc LATTE s':>11s} {'enc x':>6s} "
          f"{'e2e exact s':>11s} {'e2e LATTE s':>11s} {'e2e x':>6s} {'attn GFLOPs exact/LATTE':>24s}")
    for size in a.sizes:
        h, w = (int(x) for x in size.split("x"))
        x = torch.randn(1, 3, h, w)
        ds = DetDataSample(metainfo=dict(img_shape=(h, w), batch_input_shape=(h, w), pad_shape=(h, w)))
        batch = {"inputs": [x[0]], "data_samples": [ds]}
        model.data_preprocessor.mean.zero_()  # inputs are already normalised noise

        def e2e():
            with torch.no_grad():
                t0 = time.perf_counter()
                model(x, [ds], mode="tensor")
                return time.perf_counter() - t0

        res = {}
        for label, lin in (("exact", []), ("latte", names[: a.num_linear])):
            set_modes(layers, lin)
            res[f"enc_{label}"] = encoder_latency(model, batch, a.reps)
            e2e()
            res[f"e2e_{label}"] = min(e2e() for _ in range(a.reps))
        n = ((h + 31) // 32) * ((w + 31) // 32)
        fe = 6 * layer_flops(n, n, 256, 8, False) / 1e9
        fl = ((6 - a.num_linear) * layer_flops(n, n, 256, 8, False) + a.num_linear * layer_flops(n, n, 256, 8, True)) / 1e9
        row = dict(size=size, tokens=n, **res, enc_speedup=res["enc_exact"] / res["enc_latte"],
                   e2e_speedup=res["e2e_exact"] / res["e2e_latte"], attn_gflops_exact=fe, attn_gflops_latte=fl)
        rows.append(row)
        print(f"{size:>10s} {n:6d} {res['enc_exact']:11.3f} {res['enc_latte']:11.3f} {row['enc_speedup']:6.2f} "
              f"{res['e2e_exact']:11.3f} {res['e2e_latte']:11.3f} {row['e2e_speedup']:6.2f} {fe:11.2f} / {fl:.2f}",
              flush=True)
    t = 1000
    per_layer = layer_flops(t, t, 256, 8, False) / layer_flops(t, t, 256, 8, True)
    print(f"attention-core FLOPs per layer at T=1000 (d=256, 8 heads): exact/LATTE = {per_layer:.1f}x "
          f"(paper: 15x for a CLIP block)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "flop_ratio_T1000": per_layer}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
