#!/usr/bin/env python
"""What the speed chooser promises against what it delivers: the cost model's predicted end-to-end
speed-up of per-layer mode assignments against their measured speed-up, on a transformers detector
family or mmdet's DETR-R50 at real architecture (random weights: speed does not depend on them),
batch 1, CPU fp32.

    python -m benchmarks.speed_predict --family deimv2 --sizes 640 --speedups 1.1 1.2 max \\
        --json results/speed_predict_deimv2_s.json
    python -m benchmarks.speed_predict --family deimv2 --hf-config configs/hf/deimv2_vit6_synthetic.json \\
        --sizes 512 --from results/speed_deimv2_vit_512.json --json results/speed_measured_deimv2_vit_512.json

In this process the cost model (``latte_plugin.calibration.cost``) times every candidate layer in
every mode at the input size and the exact forward end to end, as a calibration does. Without
``--from``, for each ``--speedups`` value the assignment with the fewest non-exact layers whose
predicted speed-up reaches it (distortion is not known here: random weights); with ``--from`` a
main job's results file, each row's calibrated assignment. Every assignment, and the exact model
beside it, is then timed in fresh processes (``--reps`` passes after a warm-up, median; exact and
hybrid alternate), and the table gives predicted against measured and their error.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Optional

from latte_plugin.ops import ORDERS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The piecewise knobs of the package defaults (LatteConfig), for timing and for the assignments
#: (``--piecewise-order`` replaces the order; with ``--from``, the results file's order does).
KNOBS = {"block": 64, "order": "similarity", "rest": "latte"}


def build(family: str, side: int, hf_config: Optional[str]):
    """``(model, forward(), {candidate: tokens})`` (``benchmarks.family_speed``'s builders)."""
    from benchmarks.family_speed import build_detr_r50, build_hf

    return (build_detr_r50 if family == "detr_r50" else build_hf)(family, side, hf_config)


def apply_assignment(model, assignment: dict, knobs: dict) -> None:
    """Puts each named layer in its mode (``latte`` or ``piecewise@<top>``: the calibration's
    ``cost.set_mode``, with the piecewise ``knobs``' block, order and rest), the others exact."""
    from latte_plugin.calibration.cost import set_mode
    from latte_plugin.nn.install import find_latte_layers, set_modes

    layers = find_latte_layers(model)
    set_modes(layers, [])
    for name, mode in assignment.items():
        set_mode(layers[name], mode, knobs)


def run_point(family: str, side: int, assignment: dict, reps: int, threads: int, hf_config: Optional[str],
              knobs: dict) -> dict:
    """In this (fresh) process: the exact model and the assignment timed in alternation (medians)."""
    import torch

    from latte_plugin.nn.install import find_latte_layers, set_modes

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, forward, _ = build(family, side, hf_config)
    layers = find_latte_layers(model)
    exact, hybrid = [], []
    with torch.no_grad():
        for assigned, acc in [(False, None), (True, None)] + [(False, exact), (True, hybrid)] * reps:
            apply_assignment(model, assignment, knobs) if assigned else set_modes(layers, [])
            t0 = time.perf_counter()
            forward()
            if acc is not None:
                acc.append(time.perf_counter() - t0)
    return {"exact_s": statistics.median(exact), "hybrid_s": statistics.median(hybrid),
            "measured_speedup": statistics.median(exact) / statistics.median(hybrid)}


def measure(family: str, side: int, assignment: dict, reps: int, threads: int, hf_config: Optional[str],
            knobs: dict) -> dict:
    """:func:`run_point` in a fresh child process."""
    cmd = [sys.executable, "-m", "benchmarks.speed_predict", "--point", family, str(side), json.dumps(assignment),
           "--reps", str(reps), "--threads", str(threads), "--piecewise-order", knobs["order"],
           *(("--hf-config", hf_config) if hf_config else ())]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if out.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cost_model(family: str, side: int, threads: int, hf_config: Optional[str], knobs: Optional[dict] = None):
    """The calibration's cost model of the architecture at ``side`` (in this process)."""
    import torch

    from latte_plugin.calibration.cost import measure_costs
    from latte_plugin.nn.install import find_latte_layers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, forward, _ = build(family, side, hf_config)
    return measure_costs(find_latte_layers(model), None, lambda _b: forward(), knobs or KNOBS)


def fewest_layers(cost, speedup: str) -> dict:
    """The assignment with the fewest non-exact layers predicted at >= ``speedup`` (``max``: the fastest)."""
    from latte_plugin.calibration.front import FrontPoint, choose_point, pareto_front

    if speedup == "max":
        return cost.fastest()
    options = {n: {m: (cost.saving(n, m), 1.0) for m in c if m != "exact" and cost.saving(n, m) > 0}
               for n, c in cost.layers.items()}
    points = [FrontPoint(a, s, d, cost.predicted_speedup(a), d) for s, d, a in pareto_front(options)]
    return dict(choose_point(points, speedup=float(speedup)).assignment)


def _reachable(cost, speedup: str) -> dict:
    """:func:`fewest_layers`, or ``{}`` where the target is above what the cost model offers."""
    from latte_plugin.calibration.front import SpeedupUnreachable

    try:
        return fewest_layers(cost, speedup)
    except SpeedupUnreachable:
        return {}


def file_order(path: str) -> Optional[str]:
    """The piecewise order a main job's results file calibrated with (``None``: no piecewise layer)."""
    with open(path, encoding="utf-8") as f:
        choices = json.load(f).get("choices", {})
    orders = {(layer.get("kernel") or {}).get("order") for c in choices.values() for layer in c["layers"].values()}
    orders.discard(None)
    if len(orders) > 1:
        raise SystemExit(f"{path}: rows calibrated with different piecewise orders ({', '.join(sorted(orders))}); "
                         f"time them one file per order")
    return orders.pop() if orders else None


def calibrated_assignments(path: str) -> dict[str, dict]:
    """``{row: {layer: mode}}`` of a main job's results file (mmdet's ``hf.`` prefix dropped)."""
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    out = {}
    for row, choice in res.get("choices", {}).items():
        assignment = {}
        for n in choice["linearized"]:
            layer = choice["layers"].get(n, {})
            kernel = layer.get("kernel") or {}
            mode = layer.get("mode") or (f"piecewise@{kernel['top']}" if kernel.get("kernel") == "piecewise" else "latte")
            assignment[n[3:] if n.startswith("hf.") else n] = mode
        out[row] = assignment
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="deimv2", help="a latte_plugin.hf family, or detr_r50 (mmdet's DETR-R50)")
    p.add_argument("--hf-config", default=None, help="an architecture JSON instead of the family's (configs/hf/...)")
    p.add_argument("--sizes", type=int, nargs="+", default=[640], help="square input sides")
    p.add_argument("--speedups", nargs="+", default=["1.1", "1.2", "max"],
                   help="speed-ups to choose for (or 'max'), without --from")
    p.add_argument("--from", dest="from_results", default=None, help="a main job's results file: its rows' assignments")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", default=None, help="the model's name in the rows (default: the family)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--piecewise-order", default=None, choices=ORDERS,
                   help=f"how piecewise layers form their blocks (default: the --from file's, else {KNOBS['order']})")
    p.add_argument("--point", nargs=3, metavar=("FAMILY", "SIDE", "ASSIGNMENT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    order = a.piecewise_order or (a.from_results and file_order(a.from_results)) or KNOBS["order"]
    knobs = {**KNOBS, "order": order}
    if a.point:  # a child: one assignment, printed as JSON
        print(json.dumps(run_point(a.point[0], int(a.point[1]), json.loads(a.point[2]), a.reps, a.threads, a.hf_config,
                                   knobs)))
        return {}
    rows = []
    for side in a.sizes:
        cost = cost_model(a.family, side, a.threads, a.hf_config, knobs)
        wanted = calibrated_assignments(a.from_results) if a.from_results else {
            f"speedup={s}": _reachable(cost, s) for s in a.speedups}
        for name, assignment in wanted.items():
            if not assignment:
                print(f"{a.label or a.family} {side}px {name}: nothing to time (all exact, or above the "
                      f"{cost.predicted_speedup(cost.fastest()):.2f}x the cost model offers)", flush=True)
                continue
            got = measure(a.family, side, assignment, a.reps, a.threads, a.hf_config, knobs)
            pred = cost.predicted_speedup(assignment)
            rows.append({"model": a.label or a.family, "side": side, "row": name, "assignment": assignment,
                         "predicted_speedup": pred, **got, "error": pred / got["measured_speedup"] - 1.0,
                         "exact_ms_cost_model": cost.exact_ms, "ceiling_speedup": cost.entry()["ceiling_speedup"],
                         "cost_scale": cost.scale, "piecewise_order": order})
            r = rows[-1]
            print(f"{r['model']} {side}px {name:22s} {len(assignment):2d} layers  predicted {pred:.2f}x  measured "
                  f"{got['measured_speedup']:.2f}x  ({100 * r['error']:+.0f}%)", flush=True)
    from benchmarks.family_speed import write_rows

    return write_rows(rows, "benchmarks.speed_predict", argv, a.json)


if __name__ == "__main__":
    main()
