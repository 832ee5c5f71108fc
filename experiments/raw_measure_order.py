#!/usr/bin/env python
"""Does the raw-output MSE, compared query slot by query slot, see what a ViT block's kernel costs?
A diagnostic for the speed chooser at large inputs (``docs/results.md#speed``).

DEIMv2 takes its decoder queries from the encoder's top-scoring tokens, so a small change upstream
can reorder the query slots; the raw-output MSE (``calibration.measures.RawDistortion``) then
compares different objects slot by slot. Here each ViT block in turn runs LATTE (its calibrated
scalars) or the piecewise kernel (similarity blocks, LATTE rest, ``gamma`` 1), with no output
correction, on a few train images; beside the slot-by-slot MSE against the exact model, the MSE
after matching every exact query to one query of the changed model (Hungarian, on the boxes' L1).

    python -m experiments.raw_measure_order work_dirs/speed/1440/latte_calibrated.pth \
        --data-root data/synthetic_1440_2key --input-size 1440 --results results/raw_measure_order_1440.json
"""
from __future__ import annotations

import argparse
import itertools

from experiments.speed_job import CONFIG

MODES = ("latte", "piecewise@8", "piecewise@1")


def matched_mse(ref: list[tuple], out: list[tuple]) -> tuple[float, float]:
    """``(slot-by-slot MSE, box-matched MSE)`` of raw outputs ``[(logits (1, Q, C), boxes (1, Q, 4))]``:
    :class:`~latte_plugin.calibration.measures.RawDistortion` and its matched form, summed over images."""
    from latte_plugin.calibration.measures import MatchedRawDistortion, RawDistortion

    measures = (RawDistortion(lambda b: b, relative=False), MatchedRawDistortion(lambda b: b))
    return tuple(m.loss(sum(m.sums(r, o) for r, o in zip(ref, out))) for m in measures)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a calibrated checkpoint of the embedded ViT detector (its LATTE scalars)")
    p.add_argument("--data-root", required=True)
    p.add_argument("--input-size", type=int, required=True)
    p.add_argument("--num-images", type=int, default=3)
    p.add_argument("--results", required=True)
    a = p.parse_args(argv)
    import shlex
    import sys

    import torch

    from experiments.main_job import use_data_root, use_input_size
    from latte_plugin.calibration.corrections import reset_correction
    from latte_plugin.mmdet.calibrate import ADAPTER, build_calibration_loader
    from latte_plugin.mmdet.workflow import load_config, runner_with_checkpoint
    from latte_plugin.nn.install import find_latte_layers
    from latte_plugin.storage import atomic_write_json

    cfg = load_config(CONFIG)
    cfg.work_dir = "work_dirs/raw_measure_order"
    use_data_root(cfg, a.data_root)
    use_input_size(cfg, a.input_size)
    model = ADAPTER.unwrap(runner_with_checkpoint(cfg, a.checkpoint).model).eval()
    layers = find_latte_layers(model)
    for layer in layers.values():
        layer.mode = "exact"
    forward = ADAPTER.forward(model)
    batches = [s for b in itertools.islice(build_calibration_loader(cfg), a.num_images) for s in ADAPTER.split(b)]
    batches = batches[:a.num_images]

    def run() -> list[tuple]:
        with torch.no_grad():
            return [tuple(t.double() for t in forward(b)) for b in batches]

    ref, rows = run(), {}
    for name in (n for n in layers if ".backbone." in n):
        layer = layers[name]
        saved = {k: v.clone() for k, v in layer.state_dict().items()}
        reset_correction(layer)
        rows[name] = {}
        for mode in MODES:
            if mode == "latte":
                layer.kernel = "latte"
            else:
                layer.set_piecewise(int(mode.split("@")[1]), 1.0, "latte", 64, "similarity")
            layer.mode = "linear"
            slot, matched = matched_mse(ref, run())
            rows[name][mode] = {"slot_mse": slot, "matched_mse": matched}
            layer.mode = "exact"
            print(f"{name}: {mode:12s} slot-by-slot MSE {slot:.4f}  box-matched MSE {matched:.4f}", flush=True)
        layer.load_state_dict(saved)
    out = {"command": "python -m experiments.raw_measure_order " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "checkpoint": a.checkpoint, "input_size": a.input_size, "images": len(batches), "rows": rows}
    atomic_write_json(out, a.results)
    return out


if __name__ == "__main__":
    main()
