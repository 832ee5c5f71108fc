#!/usr/bin/env python
"""LATTE (Triton kernel and eager path) vs flash SDPA on a CUDA GPU, N = 1k .. 64k, in under 5 minutes.

    python -m benchmarks.gpu_attention [--ns 1024 4096 16384 65536] [--dtype bf16 fp16]
        [--heads 8] [--head-dim 32] [--json results/attention_gpu.json]

Times, side by side in one run and with CUDA events (best of ``--reps`` after warm-up):
``torch.nn.functional.scaled_dot_product_attention`` restricted to the flash backend (the
paper compares with FlashAttention), the Triton LATTE kernel a calibrated layer runs on CUDA
(``triton_latte.triton_latte_attention``, checked against the eager path before timing), the
eager fused path (``kernels.fused_latte_attention``), and a device memcpy of the same bytes
(q, k, v in, o out) as the roofline. Prints ms, flash/kernel, kernel/memcpy and peak memory,
and writes JSON; it needs a GPU (it exits with a message otherwise).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from latte_plugin import ops as K
from latte_plugin.ops import triton_latte as T

from benchmarks.attention import DTYPES, peak_mem as peak  # the CPU benchmark's helpers, shared



def cuda_time(fn, reps: int) -> float:
    """Best of ``reps`` CUDA-event timings in ms (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json")
    return p.parse_args(argv)


def flash_sdpa(q, k, v):
    """SDPA restricted to the flash backend (what the paper compares with)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def measure_point(a: argparse.Namespace, name: str, n: int) -> dict:
    """One dtype and token count: the kernel (checked against the eager path first), the eager
    path, flash SDPA and the memcpy roofline, side by side; the tensors are freed on return."""
    dev, dt = torch.device("cuda"), DTYPES[name]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn((a.batch, a.heads, n, a.head_dim), generator=g, device=dev, dtype=dt) for _ in range(3))
    m = torch.full((a.heads, 1, 1), 0.8, device=dev)
    rho = torch.full((a.heads, 1, 1), 50.0, device=dev)
    buf = torch.empty(4 * q.numel(), device=dev, dtype=dt)
    src = torch.cat([q.flatten(), k.flatten(), v.flatten(), v.flatten()])
    eager = lambda: K.fused_latte_attention(q, k, v, m, rho)  # noqa: E731
    latte = lambda: T.triton_latte_attention(q, k, v, m, rho)  # noqa: E731
    err = (latte().float() - eager().float()).abs().max().item()
    if err > 5e-2:
        raise SystemExit(f"the Triton kernel differs from the eager path by {err} at N={n} ({name})")
    try:
        flash_sdpa(q, k, v)
        t_flash, m_flash = cuda_time(lambda: flash_sdpa(q, k, v), a.reps), peak(lambda: flash_sdpa(q, k, v))
    except RuntimeError as e:  # fp32, or a head size flash does not take
        t_flash, m_flash = float("nan"), 0
        print(f"  (flash unavailable for {name}: {str(e).splitlines()[0]})")
    t_latte, t_eager, m_latte = cuda_time(latte, a.reps), cuda_time(eager, a.reps), peak(latte)
    t_copy = cuda_time(lambda: buf.copy_(src), a.reps)
    return dict(dtype=name, n=n, kernel_ms=t_latte, eager_ms=t_eager, flash_ms=t_flash, memcpy_ms=t_copy,
                speedup=t_flash / t_latte, roofline=t_latte / t_copy, max_abs_diff_vs_eager=err,
                kernel_mib=m_latte / 2**20, flash_mib=m_flash / 2**20)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (the CPU one is benchmarks/attention.py)")
    print(f"{torch.cuda.get_device_name()} | batch {a.batch}, {a.heads} heads of {a.head_dim}")
    print(f"{'dtype':5s} {'N':>6s} {'kernel ms':>9s} {'eager ms':>9s} {'flash ms':>9s} {'memcpy ms':>9s} "
          f"{'flash/kernel':>12s} {'kernel/memcpy':>13s} {'kernel MiB':>10s} {'flash MiB':>9s}")
    rows = []
    for name in a.dtype:
        for n in a.ns:
            row = measure_point(a, name, n)
            rows.append(row)
            print(f"{name:5s} {n:6d} {row['kernel_ms']:9.3f} {row['eager_ms']:9.3f} {row['flash_ms']:9.3f} "
                  f"{row['memcpy_ms']:9.3f} {row['speedup']:11.2f}x {row['roofline']:13.1f} {row['kernel_mib']:10.1f} "
                  f"{row['flash_mib']:9.1f}")
            torch.cuda.empty_cache()
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
