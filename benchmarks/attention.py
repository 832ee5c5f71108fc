#!/usr/bin/env python
"""Latency of LATTE linear attention vs SDPA vs naive softmax, side by side in one run.

    python -m benchmarks.attention [--dtype fp32 bf16] [--ns 128 256 ... 32768] [--json out.json] [--plot out.png]

Per N (batch 1, 8 heads of 32 by default) it reports the best of ``--reps`` runs of:
``latte`` (feature maps + JPN + linear attention, the inference path of a calibrated
layer), ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``), ``naive``
(materialised softmax, skipped above ``--naive-max``), and ``memcpy`` (copying q, k, v
in and o out: the memory roofline). Ratios are measured in the same process.
"""
from __future__ import annotations

import argparse
import time

from typing import Optional

import torch


from latte_plugin import ops as K
from latte_plugin.ops.flops import exact_attention_flops, linear_attention_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def best_time(fn, reps: int, min_time: float = 0.05) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= min_time or n >= 50:
                break
        best = min(best, el / n)
    return best


def peak_mem(fn) -> Optional[int]:
    """Peak extra bytes the call allocates on a CUDA device (the caching allocator's statistics).

    On CPU there is no allocator statistic that sees torch's tensors (``tracemalloc`` does
    not), so nothing is reported (``None``) rather than a wrong figure."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--naive-max", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the fused path")
    p.add_argument("--piecewise-tops", type=int, nargs="*", default=[],
                   help="also time the piecewise kernel (docs/method.md#piecewise) at these exact-block counts")
    p.add_argument("--piecewise-order", default="similarity", choices=K.ORDERS)
    p.add_argument("--piecewise-rest", default="latte", choices=K.RESTS)
    p.add_argument("--json")
    p.add_argument("--plot")
    return p.parse_args(argv)


def measure_point(a: argparse.Namespace, dname: str, n: int) -> dict:
    """One dtype and token count: LATTE's fused path (and its compiled form), SDPA, the naive
    reference and a memcpy of the same bytes, side by side, best of ``a.reps``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, a.heads, n, a.head_dim, generator=g).to(a.device, DTYPES[dname]) for _ in range(3))
    m, rho = torch.tensor(0.6, device=a.device), 4.0
    compiled = K.compiled_fused_latte_attention() if a.compile else None
    src = torch.cat([q, k, v, v]).contiguous()
    dst = torch.empty_like(src)
    fns = {"latte": lambda: K.fused_latte_attention(q, k, v, m, rho),  # what a calibrated 'latte' layer runs
           "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
           "memcpy": lambda: dst.copy_(src)}
    sync = (lambda: torch.cuda.synchronize()) if a.device.startswith("cuda") else (lambda: None)
    nan = float("nan")
    for top in a.piecewise_tops:  # what a calibrated piecewise layer runs (gamma does not change the cost)
        spec = K.PiecewiseSpec(top, 1.5, a.piecewise_rest, order=a.piecewise_order)
        fns[f"piecewise@{top}"] = lambda spec=spec: K.piecewise_attention(q, k, v, spec, m, rho)
    with torch.no_grad():
        t = {name: best_time(lambda f=f: (f(), sync()), a.reps) for name, f in fns.items()}
        t["naive"] = best_time(lambda: (K.naive_softmax_attention(q, k, v), sync()), a.reps) if n <= a.naive_max else nan
        t["compiled"] = best_time(lambda: (compiled(q, k, v, m, rho), sync()), a.reps) if a.compile else nan
        mem = {"latte": peak_mem(fns["latte"]), "sdpa": peak_mem(fns["sdpa"])}
    fl = exact_attention_flops(n, n, a.head_dim, a.head_dim, a.heads) / linear_attention_flops(
        n, n, a.head_dim, a.head_dim, a.heads)
    return dict(dtype=dname, n=n, latte_ms=1e3 * t["latte"], sdpa_ms=1e3 * t["sdpa"],
                naive_ms=1e3 * t["naive"], memcpy_ms=1e3 * t["memcpy"],
                speedup_vs_sdpa=t["sdpa"] / t["latte"], latte_over_memcpy=t["latte"] / t["memcpy"],
                flop_ratio=fl, peak_bytes_latte=mem["latte"], peak_bytes_sdpa=mem["sdpa"],
                compiled_ms=1e3 * t["compiled"], speedup_compiled_vs_sdpa=t["sdpa"] / t["compiled"],
                compiled_over_memcpy=t["compiled"] / t["memcpy"],
                **{f"{name}_ms": 1e3 * t[name] for name in t if name.startswith("piecewise@")},
                **{f"speedup_{name}_vs_sdpa": t["sdpa"] / t[name] for name in t if name.startswith("piecewise@")})


def plot(rows: list[dict], a: argparse.Namespace) -> None:
    """Latency against N, log-log, per dtype: LATTE, SDPA and the memcpy floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dname in a.dtype:
        rs = [r for r in rows if r["dtype"] == dname]
        for key, style in (("latte_ms", "-o"), ("sdpa_ms", "--s"), ("memcpy_ms", ":")):
            ax.plot([r["n"] for r in rs], [r[key] for r in rs], style, label=f"{key[:-3]} {dname}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("ms (best of reps)")
    ax.set_title(f"attention latency, {a.heads}x{a.head_dim}, {a.device}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rows = []
    print(f"device={a.device} threads={torch.get_num_threads()} heads={a.heads} head_dim={a.head_dim}")
    print(f"{'dtype':5s} {'N':>6s} {'latte ms':>9s} {'sdpa ms':>9s} {'naive ms':>9s} {'memcpy ms':>9s} "
          f"{'sdpa/latte':>10s} {'latte/memcpy':>12s} {'FLOP ratio':>10s} {'compiled ms':>11s} {'sdpa/comp.':>10s} "
          f"{'comp./memcpy':>12s}")
    for dname in a.dtype:
        for n in a.ns:
            row = measure_point(a, dname, n)
            rows.append(row)
            print(f"{dname:5s} {n:6d} {row['latte_ms']:9.3f} {row['sdpa_ms']:9.3f} {row['naive_ms']:9.3f} "
                  f"{row['memcpy_ms']:9.3f} {row['speedup_vs_sdpa']:10.2f} {row['latte_over_memcpy']:12.1f} "
                  f"{row['flop_ratio']:10.1f} {row['compiled_ms']:11.3f} {row['speedup_compiled_vs_sdpa']:10.2f} "
                  f"{row['compiled_over_memcpy']:12.1f}"
                  + "".join(f"  piecewise@{t} {row[f'piecewise@{t}_ms']:.3f} ms ({row[f'speedup_piecewise@{t}_vs_sdpa']:.2f}x)"
                            for t in a.piecewise_tops), flush=True)
    if a.json:
        import shlex
        import sys

        from latte_plugin.storage import atomic_write_json

        atomic_write_json({"device": a.device, "threads": torch.get_num_threads(), "heads": a.heads,
                           "head_dim": a.head_dim, "piecewise_order": a.piecewise_order,
                           "piecewise_rest": a.piecewise_rest, "rows": rows,
                           "command": "python -m benchmarks.attention " + shlex.join(
                               argv if argv is not None else sys.argv[1:])}, a.json)
    if a.plot:
        plot(rows, a)
    return rows


if __name__ == "__main__":
    main()
