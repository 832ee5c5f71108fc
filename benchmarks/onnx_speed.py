#!/usr/bin/env python
"""onnxruntime CPU latency of exact vs LATTE-hybrid graphs, side by side in one run.

    python -m benchmarks.onnx_speed [--ns 1024 4096 16384] [--sizes 800x1333 1600x2666] [--reps 3]
        [--threads 2] [--json results/onnx_cpu.json]

Two parts, each graph exported by :func:`latte_plugin.export_onnx` and timed in onnxruntime
(best of ``--reps`` after one warm-up), with a ``memcpy`` row (one Identity-free copy of the
same q, k, v bytes through onnxruntime's ``Add`` of zero) as the memory roofline measured in
the same run:

* **attention only**: one multi-head attention layer (d = 256, 8 heads, batch 1) over N
  tokens, exact (softmax through SDPA) vs calibrated LATTE linear;
* **DETR-R50** (mmdet's config, random weights: fine for timing) end to end on one image,
  exact vs 4 of 6 encoder layers linear (67%, the paper's protocol).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn

from latte_plugin.export import export_onnx, session_for
from latte_plugin.nn.install import find_latte_layers, set_modes


def best_ms(session, feeds: dict, reps: int) -> float:
    session.run(None, feeds)  # warm-up (allocations, kernel selection)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def time_graph(module: nn.Module, x: torch.Tensor, reps: int, threads: int, tmp: str, name: str) -> float:
    path = export_onnx(module, x, os.path.join(tmp, f"{name}.onnx"), input_names=["x"])
    return best_ms(session_for(path, threads), {"x": x.numpy()}, reps)


class Copy(nn.Module):
    """The memory roofline: reads the input and writes as many bytes as q, k, v and o."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.0


def attention_layer(dim: int = 256, heads: int = 8) -> nn.Module:
    """One ``nn.MultiheadAttention`` with LATTE installed and calibrated-like scalars."""
    from latte_plugin.adapter import swap_attention

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    layer = Layer().eval()
    swap_attention(layer, ["attn"])
    latte = find_latte_layers(layer)["attn"]
    latte.m.fill_(0.7)
    latte.log_rho.fill_(1.0)
    latte.calibrated.fill_(True)
    return layer


def attention_sweep(ns: list[int], reps: int, threads: int, tmp: str) -> list[dict]:
    layer = attention_layer()
    latte = find_latte_layers(layer)["attn"]
    rows = []
    for n in ns:
        x = torch.randn(1, n, 256)
        row = {"part": "attention", "N": n}
        for mode in ("exact", "linear"):
            latte.mode = mode
            row[f"{mode}_ms"] = time_graph(layer, x, reps, threads, tmp, f"attn_{mode}_{n}")
        row["memcpy_ms"] = time_graph(Copy(), torch.randn(1, 4 * n, 256), reps, threads, tmp, f"copy_{n}")
        row["speedup"] = row["exact_ms"] / row["linear_ms"]
        rows.append(row)
        print(f"attention N={n:6d}: exact {row['exact_ms']:9.2f} ms  LATTE {row['linear_ms']:8.2f} ms  "
              f"({row['speedup']:.2f}x)  memcpy {row['memcpy_ms']:.2f} ms", flush=True)
    return rows


def detr_r50(sizes: list[str], reps: int, threads: int, tmp: str) -> list[dict]:
    from benchmarks.detector import detr_r50_with_latte
    from latte_plugin.mmdet.export import RawOutputs

    model, names, layers = detr_r50_with_latte()
    wrapped = RawOutputs(model).eval()
    rows = []
    for size in sizes:
        h, w = (int(v) for v in size.split("x"))
        x = torch.randn(1, 3, h, w)
        row = {"part": "detr_r50", "input": size, "tokens": -(-h // 32) * -(-w // 32)}
        for label, linear in (("exact", []), ("linear", names[:4])):
            set_modes(layers, linear, "linear")
            row[f"{label}_ms"] = time_graph(wrapped, x, reps, threads, tmp, f"detr_{label}_{size}")
        row["speedup"] = row["exact_ms"] / row["linear_ms"]
        rows.append(row)
        print(f"DETR-R50 {size} ({row['tokens']} tokens): exact {row['exact_ms']:.0f} ms  4/6 LATTE "
              f"{row['linear_ms']:.0f} ms  ({row['speedup']:.2f}x)", flush=True)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--sizes", nargs="*", default=["800x1333", "1600x2666"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    a = p.parse_args(argv)
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__}, CPU, {a.threads} threads, best of {a.reps}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = attention_sweep(a.ns, a.reps, a.threads, tmp) + (detr_r50(a.sizes, a.reps, a.threads, tmp)
                                                                  if a.sizes else [])
    if a.json:
        from latte_plugin.storage import atomic_write_json

        atomic_write_json({"onnxruntime": onnxruntime.__version__, "threads": a.threads, "reps": a.reps,
                           "rows": rows}, a.json)
    return rows


if __name__ == "__main__":
    main()
