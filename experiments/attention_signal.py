#!/usr/bin/env python
"""The signal column: for every LATTE candidate of an mmdet config, how much the detector's raw
outputs move when that layer's attention output is replaced by the mean of its values (the
others exact), on train images (``latte_plugin.calibration.signal``), and how far each layer's softmax is
from uniform (mean row entropy over log N: 1 = uniform).

    python -m experiments.attention_signal configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py \
        checkpoints/rtdetr_r18_synthetic.pth --results results/signal_rtdetr.json

A layer the detector ignores scores ~0: linearizing it proves nothing about linear attention.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
from latte_plugin.console import first_paragraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(config: str, checkpoint: str, num_images: int, work_dir: str) -> tuple[dict, dict]:
    """``({layer: signal}, {layer: attention entropy / log N})`` of every candidate, on the first
    ``num_images`` train images."""
    from latte_plugin.nn.install import find_latte_layers
    from latte_plugin.calibration.signal import attention_sharpness, attention_signal
    from latte_plugin.mmdet.calibrate import ADAPTER, build_calibration_loader
    from latte_plugin.mmdet.workflow import load_config, runner_with_checkpoint

    cfg = load_config(config)
    cfg.work_dir = work_dir
    runner = runner_with_checkpoint(cfg, checkpoint)
    model = ADAPTER.unwrap(runner.model).eval()
    batches = [s for b in itertools.islice(build_calibration_loader(cfg), num_images) for s in ADAPTER.split(b)]
    layers, forward = find_latte_layers(model), ADAPTER.forward(model)
    return (attention_signal(layers, batches[:num_images], forward),
            attention_sharpness(layers, batches[:num_images], forward))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("config")
    p.add_argument("checkpoint")
    p.add_argument("--num-images", type=int, default=16, help="train images measured (default: 16)")
    p.add_argument("--results", required=True, help="JSON to write")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "work_dirs", "signal"))
    a = p.parse_args(argv)
    from latte_plugin.storage import atomic_write

    signal, entropy = measure(a.config, a.checkpoint, a.num_images, a.work_dir)
    rel = lambda path: os.path.relpath(os.path.abspath(path), ROOT)  # noqa: E731
    out = {"command": f"python -m experiments.attention_signal {rel(a.config)} {rel(a.checkpoint)} --num-images "
                      f"{a.num_images} --results {rel(a.results)}",
           "config": rel(a.config), "checkpoint": rel(a.checkpoint), "num_images": a.num_images, "signal": signal,
           "entropy": entropy}
    atomic_write(a.results, lambda f: f.write(json.dumps(out, indent=1).encode("utf-8")))
    for name, value in signal.items():
        print(f"{value:10.3e}  entropy/log N {entropy.get(name, float('nan')):.3f}  {name}")
    return out


if __name__ == "__main__":
    main()
