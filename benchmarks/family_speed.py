#!/usr/bin/env python
"""End-to-end speed against input size for a transformers detector family at its real architecture
(random weights: speed does not depend on them): exact vs hybrid, same weights, batch 1, CPU fp32.

    python -m benchmarks.family_speed --family deimv2 --sizes 640 896 1280 --reps 3 \
        --json results/family_speed_deimv2.json [--plot docs/family_speed_deimv2.png]

Each (size, setting) point runs in a fresh process (peak RSS is that process's ``ru_maxrss``),
with ``--threads`` torch threads, one warm-up pass, then ``--reps`` timed passes (median kept).
Settings: ``exact``, and the 67% / 83% hybrids (``--kernel compiled``: their linear layers through
``torch.compile``, ``LATTE_KERNEL=compiled``). Which candidates go linear is not calibrated
here: the ones with the longest sequences are taken first (the ViT blocks before AIFI and the
decoder), so the figure is the speed-up a calibration choosing those layers would give, an upper
bound for that count. With ``--linear-from results/main_job_X.json`` the linear sets are the ones
the calibration chose (its ``ours:auto`` and ``ours:auto@83%`` rows), with ``--hf-config`` another
architecture (e.g. the embedded ViT detector's ``configs/hf/deimv2_vit6_synthetic.json``). The exact model's share of time inside its candidate attention layers is
reported at each size: the ceiling any linear attention can lift.
"""
from __future__ import annotations

import argparse
import json
import shlex
import os
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {"exact": 0.0, "67%": 0.67, "83%": 0.83}


#: The main-job rows whose calibrated linear sets ``--linear-from`` takes, per setting.
CALIBRATED_ROWS = {"67%": "ours:auto", "83%": "ours:auto@83%"}


def calibrated_linear(path: str, setting: str) -> list[str]:
    """The HF module names a main job's calibration made linear for ``setting`` (mmdet's ``hf.`` dropped)."""
    with open(path, encoding="utf-8") as f:
        row = json.load(f)["rows"][CALIBRATED_ROWS[setting]]
    return [n[3:] if n.startswith("hf.") else n for n in row["linearized"]]


def run_point(family: str, side: int, setting: str, reps: int, threads: int, hf_config: Optional[str] = None,
              linear_from: Optional[str] = None) -> dict:
    """In this process: build, set the modes, time; returns the point's figures."""
    import torch

    from latte_plugin.nn.install import find_latte_layers, set_modes
    from latte_plugin.calibration.config import num_linear_layers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    build = build_detr_r50 if family == "detr_r50" else build_hf
    model, forward, tokens = build(family, side, hf_config)
    layers = find_latte_layers(model)
    k = num_linear_layers(len(tokens), SETTINGS[setting]) if SETTINGS[setting] else 0
    linear = sorted(tokens, key=lambda n: -tokens[n])[:k]
    if linear_from and k:
        linear = calibrated_linear(linear_from, setting)
    set_modes(layers, linear)
    spent = _attention_clock(model, list(tokens))
    with torch.no_grad():
        forward()  # warm-up
        times, shares = [], []
        for _ in range(reps):
            spent[0] = 0.0
            t0 = time.perf_counter()
            forward()
            times.append(time.perf_counter() - t0)
            shares.append(spent[0] / times[-1])
    return dict(family=family, side=side, setting=setting, linear=len(linear), candidates=len(tokens),
                tokens=max(tokens.values()), seconds=statistics.median(times), runs=times,
                attention_share=statistics.median(shares), threads=threads,
                kernel=os.environ.get("LATTE_KERNEL", "eager"))


def build_hf(family: str, side: int, hf_config: Optional[str]) -> tuple:
    """A transformers detector with LATTE in every candidate: ``(model, forward(), {candidate: tokens})``."""
    import torch

    from latte_plugin.adapter import swap_attention
    from latte_plugin.hf.detectors import FAMILIES, build_detector
    from latte_plugin.hf.discovery import detector_sites

    model = build_detector(family, hf_config or FAMILIES[family].architecture).eval()
    x = torch.rand(1, 3, side, side)
    sites = [s for s in detector_sites(model, (side, side)) if s.candidate]
    swap_attention(model, [s.name for s in sites])
    return model, lambda: model(pixel_values=x), {s.name: s.tokens for s in sites}


def build_detr_r50(family: str, side: int, hf_config: Optional[str]) -> tuple:
    """mmdet's DETR-R50 (``benchmarks/detector.py``: real architecture, random weights) with LATTE in
    its 6 encoder layers, on a ``side`` x ``side`` input (stride 32): ``(model, forward(), {layer: tokens})``."""
    import torch
    from mmdet.structures import DetDataSample

    from benchmarks.detector import detr_r50_with_latte

    model, names, _ = detr_r50_with_latte()
    x = torch.randn(1, 3, side, side)
    sample = DetDataSample(metainfo=dict(img_shape=(side, side), batch_input_shape=(side, side), pad_shape=(side, side)))
    tokens = ((side + 31) // 32) ** 2
    return model, lambda: model(x, [sample], mode="tensor"), {n: tokens for n in names}


def _attention_clock(model, names: list[str]) -> list[float]:
    """Adds the wall time spent inside the named modules to ``clock[0]`` on every forward."""
    clock, started = [0.0], {}
    modules = dict(model.named_modules())
    for name in names:
        mod = modules[name]
        mod.register_forward_pre_hook(lambda m, a, started=started: started.__setitem__(id(m), time.perf_counter()))
        mod.register_forward_hook(
            lambda m, a, o, started=started: clock.__setitem__(0, clock[0] + time.perf_counter() - started[id(m)]))
    return clock


def measure(family: str, side: int, setting: str, reps: int, threads: int, extra: Sequence[str] = (),
            kernel: str = "eager") -> dict:
    """One point in a fresh child process (``extra``: more of this script's options; ``kernel``: its
    ``LATTE_KERNEL``, the linear layers' CPU path); adds its peak RSS (GiB)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--point", family, str(side), setting, "--reps", str(reps),
           "--threads", str(threads), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS=str(threads), LATTE_KERNEL=kernel))
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    row = json.loads(out.strip().splitlines()[-1])
    row["peak_rss_gib"] = round(usage.ru_maxrss / 2**20, 2)
    return row


def write_rows(rows: list[dict], module: str, argv, path: Optional[str]) -> dict:
    """``{"rows", "command", "machine"}`` of a benchmark run, written atomically to ``path`` if given."""
    # the allocator settings and the load move CPU timings (tools/cpu_env.sh; a second job on the
    # cores): the file records both (the load counts the run's own threads), so a figure can be traced
    out = {"rows": rows, "command": f"python -m {module} " + shlex.join(argv or sys.argv[1:]),
           "machine": f"{os.cpu_count()} CPU cores",
           "allocator": {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")},
           "load_average_1min": os.getloadavg()[0]}
    if path:
        from latte_plugin.storage import atomic_write_json

        atomic_write_json(out, path)
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    exact = {r["side"]: r["seconds"] for r in rows if r["setting"] == "exact"}
    for setting in sorted({r["setting"] for r in rows} - {"exact"}, key=list(SETTINGS).index):
        pts = sorted((r["tokens"], exact[r["side"]] / r["seconds"]) for r in rows if r["setting"] == setting)
        ax.plot(*zip(*pts), marker="o", label=f"{setting} linear")
    share = sorted((r["tokens"], 1 / (1 - r["attention_share"])) for r in rows if r["setting"] == "exact")
    ax.plot(*zip(*share), linestyle="--", color="grey", label="ceiling (attention time removed)")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("tokens of the longest candidate")
    ax.set_ylabel("end-to-end speed-up vs exact")
    ax.set_title(f"{rows[0].get('model', rows[0]['family'])}: CPU fp32, batch 1, {rows[0]['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="deimv2", help="a latte_plugin.hf family, or detr_r50 (mmdet's DETR-R50)")
    p.add_argument("--sizes", type=int, nargs="+", default=[640, 896, 1280], help="square input sides")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--plot", default=None, help="write the speed-up plot here (PNG)")
    p.add_argument("--hf-config", default=None, help="an architecture JSON instead of the family's (configs/hf/...)")
    p.add_argument("--linear-from", default=None,
                   help="a main job's results JSON: use the linear sets its calibration chose (rows ours:auto, ours:auto@83%%)")
    p.add_argument("--label", default=None, help="the model's name in the plot and the rows (default: the family)")
    p.add_argument("--kernel", choices=("eager", "compiled"), default="eager",
                   help="the linear layers' CPU path: the eager fused function, or it through torch.compile "
                        "(LATTE_KERNEL=compiled; compiled in the untimed warm-up pass); the rest of both models is eager")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                   help="the settings timed (default: all)")
    p.add_argument("--point", nargs=3, metavar=("FAMILY", "SIDE", "SETTING"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.point:  # a child: one point, printed as JSON
        print(json.dumps(run_point(a.point[0], int(a.point[1]), a.point[2], a.reps, a.threads, a.hf_config,
                                   a.linear_from)))
        return {}
    extra = [opt for name, opt in (("hf_config", "--hf-config"), ("linear_from", "--linear-from"))
             for opt in ((opt, getattr(a, name)) if getattr(a, name) else ())]
    rows = []
    for side in a.sizes:
        for setting in a.settings:
            rows.append(dict(measure(a.family, side, setting, a.reps, a.threads, extra, a.kernel),
                             model=a.label or a.family, calibrated_sets=bool(a.linear_from)))
            r = rows[-1]
            print(f"{a.family} {side}px {setting:5s} {r['seconds']:.3f} s  attention {r['attention_share']:.0%}  "
                  f"RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
    out = write_rows(rows, "benchmarks.family_speed", argv, a.json)
    if a.plot:
        plot(rows, a.plot)
    return out


if __name__ == "__main__":
    main()
