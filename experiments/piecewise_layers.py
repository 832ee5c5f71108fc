#!/usr/bin/env python
"""Per-layer held-out reconstruction error of the attention layers of an mmdet config: exact,
LATTE, and the piecewise kernel at each exact-block count, with each way of forming the blocks
and of approximating the rest (``docs/method.md#piecewise``).

    python -m experiments.piecewise_layers configs/mmdet/embedded/deimv2_vit6_synthetic_latte.py \
        checkpoints/deimv2_vit6_synthetic.pth --results results/piecewise_layers_deimv2_vit.json

The calibration images (train split) alternate between two roles by position: the even ones fit
(LATTE's scalars, the piecewise mass scale ``gamma`` at each count), the odd ones only measure.
Errors are relative: the MSE of the layer's attention output (before any output correction)
over the mean square of the exact output, on the measuring images.
"""
from __future__ import annotations

import argparse
import fnmatch
import itertools
import os
from latte_plugin.console import first_paragraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIT_BLOCKS = "hf.model.conv_encoder.backbone.model.layer.*.attention"


def record(config: str, checkpoint: str, pattern: str, num_images: int, max_queries: int, block: int,
           data_root: str | None, work_dir: str, order: str, input_size: int | None = None) -> dict:
    """``{layer: (LatteParams, [fit items], [measuring items])}`` of the layers matching ``pattern``."""
    from latte_plugin.calibration.record import LayerRecorder, share_items
    from latte_plugin.calibration.taps import exact_taps
    from latte_plugin.mmdet.calibrate import ADAPTER, build_calibration_loader
    from latte_plugin.mmdet.workflow import load_config, runner_with_checkpoint
    from latte_plugin.nn.install import find_latte_layers

    cfg = load_config(config)
    cfg.work_dir = work_dir
    if data_root:
        from experiments.main_job import use_data_root

        use_data_root(cfg, data_root)
    if input_size:
        from experiments.main_job import use_input_size

        use_input_size(cfg, input_size)
    runner = runner_with_checkpoint(cfg, checkpoint)
    model = ADAPTER.unwrap(runner.model).eval()
    layers = {n: lay for n, lay in find_latte_layers(model).items() if fnmatch.fnmatch(n, pattern)}
    if not layers:
        raise SystemExit(f"no LATTE layer of {config} matches {pattern!r}")
    batches = [s for b in itertools.islice(build_calibration_loader(cfg), num_images) for s in ADAPTER.split(b)]
    recs = {n: LayerRecorder(n, num_images, max_queries, 0, pool_block=block, pool_order=order) for n in layers}
    forward = ADAPTER.forward(model)
    import torch

    with torch.no_grad(), exact_taps(layers, recs):
        for pos, batch in enumerate(batches[:num_images]):
            for r in recs.values():
                r.batch_key = pos
            forward(batch)
    out = {}
    for n, r in recs.items():
        share_items(r, lambda t: t, (0, 1))
        fit = [it for it in r.items if (it.key // 1024) % 2 == 0]
        held = [it for it in r.items if (it.key // 1024) % 2 == 1]
        out[n] = (layers[n], fit, held)
    return out


def _relative_mse(layer, items) -> float:
    from latte_plugin.calibration.corrections import linear_outputs
    from latte_plugin.calibration.record import stack_by_shape

    sse = energy = 0.0
    for it in stack_by_shape(list(items)):
        o = linear_outputs(layer, it, layer.m.double(), layer.log_rho.double())
        sse += float(((o - it.target) ** 2).sum())
        energy += float((it.target ** 2).sum())
    return sse / energy


def measure_layer(layer, fit: list, held: list, tops, gammas, block: int, order: str) -> dict:
    """One layer's row: LATTE fitted on ``fit``; each (rest, top) with gamma chosen on ``fit``; errors on ``held``."""
    from latte_plugin import ops
    from latte_plugin.calibration.fit import fit_layer

    fit_layer(layer, fit, correction="none", steps=20)
    row = {"tokens": int(fit[0].k.shape[-2]), "alpha": layer.alpha, "latte": _relative_mse(layer, held),
           "latte_fit": _relative_mse(layer, fit), "piecewise": {}}
    for rest in ops.RESTS:
        row["piecewise"][rest] = {}
        for top in tops:
            best = None
            for g in gammas:
                layer.set_piecewise(top, g, rest, block, order)
                e = _relative_mse(layer, fit)
                if best is None or e < best[0]:
                    best = (e, g)
            layer.set_piecewise(top, best[1], rest, block, order)
            row["piecewise"][rest][str(top)] = {"gamma": best[1], "fit": best[0], "heldout": _relative_mse(layer, held)}
    layer.kernel = "latte"
    return row


def main(argv=None) -> dict:
    from latte_plugin.calibration.config import PIECEWISE_GAMMAS, PIECEWISE_TOPS
    from latte_plugin.ops import ORDERS, PIECEWISE_BLOCK

    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("config")
    p.add_argument("checkpoint")
    p.add_argument("--candidates", default=VIT_BLOCKS, help=f"fnmatch pattern of the layers (default: {VIT_BLOCKS})")
    p.add_argument("--num-images", type=int, default=16, help="train images: half fit, half measure (default: 16)")
    p.add_argument("--max-queries", type=int, default=256, help="query tokens recorded per image (default: 256)")
    p.add_argument("--tops", type=int, nargs="+", default=list(PIECEWISE_TOPS))
    p.add_argument("--data-root", help="another generated split (its train images)")
    p.add_argument("--input-size", type=int, help="square side the pipelines resize to (default: the config's)")
    p.add_argument("--results", required=True, help="JSON to write")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "work_dirs", "piecewise_layers"))
    a = p.parse_args(argv)
    import shlex
    import time

    from latte_plugin.console import quiet
    from latte_plugin.storage import atomic_write_json

    t0 = time.time()
    by_order = {}
    for order in ORDERS:
        with quiet(os.path.join(a.work_dir, "piecewise_layers.log")):
            recorded = record(a.config, a.checkpoint, a.candidates, a.num_images, a.max_queries, PIECEWISE_BLOCK,
                              a.data_root, a.work_dir, order, a.input_size)
        rows = by_order[order] = {}
        for n, (layer, fit, held) in recorded.items():
            rows[n] = measure_layer(layer, fit, held, a.tops, PIECEWISE_GAMMAS, PIECEWISE_BLOCK, order)
            pw = "  ".join(f"{rest}@{t} {v['heldout']:.4f}" for rest, by in rows[n]["piecewise"].items()
                           for t, v in by.items())
            print(f"{order} {n}: {rows[n]['tokens']} tokens  latte {rows[n]['latte']:.4f}  {pw}", flush=True)
    out = {"command": "python -m experiments.piecewise_layers " + shlex.join(argv if argv is not None else
                                                                             __import__("sys").argv[1:]),
           "config": a.config, "checkpoint": a.checkpoint, "block": PIECEWISE_BLOCK, "num_images": a.num_images,
           "fit_images": len(next(iter(recorded.values()))[1]), "measure_images": len(next(iter(recorded.values()))[2]),
           "max_queries": a.max_queries, "measure": "relative MSE of the attention output (no output correction)",
           "seconds": round(time.time() - t0, 1), "orders": by_order}
    atomic_write_json(out, a.results)
    return out


if __name__ == "__main__":
    main()
