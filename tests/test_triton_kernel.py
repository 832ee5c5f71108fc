"""The Triton LATTE kernel against the naive reference: on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``), or compiled on a GPU where there is one (benchmarks/gpu_check.sh).
N not a multiple of the block, padded keys, fully padded images, per-head and shared scalars,
key slices, every supported dtype. ``pytest -k triton`` selects these."""
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on CPU tensors

import pytest  # noqa: E402

triton_latte = pytest.importorskip("latte_plugin.ops.triton_latte", reason="triton is not installed")
if triton_latte.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from latte_plugin import ops as kernels
from tests.conftest import qkv as _qkv  # noqa: E402


def qkv(**kw):
    return tuple(t.to(DEVICE) for t in _qkv(**kw))

#: atol/rtol per dtype: fp32 is exact up to summation order; 16-bit rounds the dot inputs
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-2), torch.bfloat16: (1.5e-2, 5e-2)}


def _reference(q, k, v, m, rho, kpm, variant="latte"):
    """The naive composition in float64: feature maps with the beta column, full score matrix."""
    h = q.shape[1]
    m_t = torch.as_tensor(m, dtype=torch.float64, device=q.device).reshape(-1).expand(h).view(h, 1, 1)
    delta = torch.as_tensor(rho, dtype=torch.float64, device=q.device).reshape(-1).expand(h).view(h, 1, 1).sqrt()
    fq, fk = kernels.variant_features(q.double(), k.double(), variant, m_t, delta, delta, 1.0, 1.0)
    return kernels.naive_linear_attention(fq, fk, v.double(), kpm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,mk,d,dv", [(37, 37, 32, 32), (70, 129, 64, 64), (5, 3, 16, 128), (130, 64, 128, 16)])
def test_triton_kernel_matches_the_naive_reference(dtype, n, mk, d, dv):
    q, k, v = qkv(b=2, h=3, n=n, m=mk, d=d, dv=dv)
    m, rho = torch.tensor([0.9, 1.1, 0.7], device=DEVICE), torch.tensor([5.0, 20.0, 2.0], device=DEVICE)  # per head
    kpm = torch.zeros(2, mk, dtype=torch.bool, device=DEVICE)
    kpm[1, mk // 2:] = True  # padded keys in the second image
    ref = _reference(q, k, v, m, rho, kpm)
    out = triton_latte.triton_latte_attention(q.to(dtype), k.to(dtype), v.to(dtype), m, rho, kpm,
                                              block_m=32, block_n=32)
    assert out.dtype == dtype and out.shape == ref.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    eager = kernels.fused_latte_attention(q.to(dtype), k.to(dtype), v.to(dtype), m.view(-1, 1, 1),
                                          rho.view(-1, 1, 1), kpm)
    torch.testing.assert_close(out.double(), eager.double(), atol=atol, rtol=rtol)


def test_triton_kernel_fully_padded_image_gives_zeros_and_jpn_only_scalars():
    q, k, v = qkv(b=2, h=2, n=20, m=33, d=32)
    kpm = torch.zeros(2, 33, dtype=torch.bool, device=DEVICE)
    kpm[0] = True  # no key at all in the first image
    out = triton_latte.triton_latte_attention(q, k, v, 1.0, 8.0, kpm)  # jpn_only: m = 1, shared rho
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:].double(), _reference(q, k, v, 1.0, 8.0, kpm, "jpn_only")[1:],
                               atol=2e-5, rtol=2e-5)


def test_triton_kernel_refuses_what_it_does_not_support():
    q, k, v = qkv(d=24)
    assert not triton_latte.supported(q, k, v)
    with pytest.raises(ValueError, match="power-of-two head dims"):
        triton_latte.triton_latte_attention(q, k, v, 1.0, 1.0)


def test_triton_dispatch_is_for_cuda_only_and_can_be_turned_off(monkeypatch):
    """``auto`` sends CPU tensors to the eager path; ``eager`` (or ``LATTE_KERNEL=eager``, read once
    when a layer is built) and ``set_enabled(False)`` turn the kernel off."""
    from latte_plugin.nn import params as layer_mod
    from latte_plugin.ops import latte as latte_ops

    q, k, v = qkv(d=32)
    assert latte_ops._triton_takes(q, k, v, "triton")  # installed and supported: the explicit backend takes it
    assert not latte_ops._triton_takes(q, k, v, "auto")  # CPU tensors: auto runs eager (CUDA ones take the kernel)
    assert not latte_ops._triton_takes(q, k, v, "eager")
    monkeypatch.setenv("LATTE_KERNEL", "eager")
    assert layer_mod.LatteParams(embed_dim=4 * 32, num_heads=4).backend == "eager"
    monkeypatch.setenv("LATTE_KERNEL", "sometimes")
    with pytest.raises(ValueError, match="LATTE_KERNEL='sometimes' is not a LATTE kernel backend"):
        layer_mod.LatteParams(embed_dim=4 * 32, num_heads=4)
    monkeypatch.delenv("LATTE_KERNEL")
    triton_latte.set_enabled(False)
    try:
        assert not latte_ops._triton_takes(q, k, v, "triton")
    finally:
        triton_latte.set_enabled(True)
    calls = []
    monkeypatch.setattr(triton_latte, "triton_latte_attention", lambda *a, **kw: calls.append(1))
    lay = layer_mod.LatteParams(embed_dim=4 * 32, num_heads=4, mode="linear")
    out = lay.attend(q.cpu(), k.cpu(), v.cpu())  # CPU: the eager fused path, not the kernel
    assert not calls and torch.isfinite(out).all()


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_triton_kernel_key_slices_sum_to_the_same_result(splits):
    """Slicing the keys across programs (with a slice boundary inside a block) changes nothing."""
    q, k, v = qkv(b=1, h=2, n=19, m=150, d=32)
    kpm = torch.zeros(1, 150, dtype=torch.bool, device=DEVICE)
    kpm[0, 100:] = True
    out = triton_latte.triton_latte_attention(q, k, v, 0.8, 6.0, kpm, block_m=16, splits=splits)
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.8, 6.0, kpm), atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------ 16-bit with calibrated scalars
#: (m, rho) of linear layers real calibrations produce: the generic HF ViT example (README;
#: delta 346, 811, 1720 -> rho = delta^2 up to 3e6) and the embedded detectors'
#: (tests/data/calibrated_scalars.json, written by experiments/record_scalars.py).
def _real_scalars():
    import json

    path = os.path.join(os.path.dirname(__file__), "data", "calibrated_scalars.json")
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["layers"]
    vit = [{"name": f"vit.delta{d}", "m": (1 - 0.95) ** 0.5, "rho": d * d} for d in (54.6, 346.0, 811.0, 1720.0)]
    return rows + vit


REAL = _real_scalars()


def _rel_err(out, ref):
    """Largest error relative to the output's own scale (the values' magnitude)."""
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rho", [1.0, 1e2, 1e4, 1.2e5, 1e6, 3e6, 1e7])
def test_triton_kernel_is_finite_and_accurate_in_16_bit_for_large_rho(dtype, rho):
    """rho far above float16's 65504 (calibrations routinely give 1e5..1e7): finite, and within
    the 16-bit rounding of the inputs of the float64 reference."""
    q, k, v = qkv(b=1, h=2, n=64, m=64, d=32)
    ref = _reference(q, k, v, 0.3, rho, None)
    out = triton_latte.triton_latte_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.3, rho)
    assert torch.isfinite(out).all(), (dtype, rho)
    assert _rel_err(out, ref) < (5e-3 if dtype == torch.float16 else 3e-2), (dtype, rho)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_kernel_is_finite_at_long_n_where_kv_exceeds_float16(dtype):
    """4,096 keys whose values share a large mean: ``K~^T V`` reaches about 1e5, beyond float16;
    it is scaled before the 16-bit dot."""
    q, k, v = qkv(b=1, h=1, n=64, m=4096, d=32)
    v = v * 10 + 300.0
    ref = _reference(q, k, v, 0.5, 1e6, None)
    out = triton_latte.triton_latte_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.5, 1e6, block_m=64)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < (5e-3 if dtype == torch.float16 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layer", REAL, ids=[r["name"] for r in REAL])
def test_real_calibrated_scalars_in_16_bit_kernel_and_eager(dtype, layer):
    """Every linear layer of both embedded calibrated detectors and of the generic example, with
    its own (m, rho) per head, through the Triton kernel and the eager 16-bit layer path."""
    from latte_plugin.nn.params import LatteParams

    m = torch.tensor(layer["m"], dtype=torch.float32).reshape(-1)
    rho = torch.tensor(layer["rho"], dtype=torch.float32).reshape(-1)
    h = max(m.numel(), rho.numel(), 2)
    m, rho = m.expand(h).contiguous(), rho.expand(h).contiguous()
    q, k, v = qkv(b=1, h=h, n=96, m=200, d=32, scale=3.0)
    kpm = torch.zeros(1, 200, dtype=torch.bool, device=DEVICE)
    kpm[0, 150:] = True
    ref = _reference(q, k, v, m, rho, kpm)
    tol = 5e-3 if dtype == torch.float16 else 3e-2
    out = triton_latte.triton_latte_attention(q.to(dtype), k.to(dtype), v.to(dtype), m, rho, kpm)
    assert torch.isfinite(out).all() and _rel_err(out, ref) < tol
    lay = LatteParams(embed_dim=h * 32, num_heads=h, mode="linear").to(DEVICE)
    lay.m.copy_(m)
    lay.log_rho.copy_(rho.log())
    lay.refit_on.fill_(True)  # a refit with weights beyond float16's step size near 1
    lay.refit_weight.copy_(torch.eye(h * 32) * 1.0001)
    eager = lay.cpu().attend(q.cpu().to(dtype), k.cpu().to(dtype), v.cpu().to(dtype), kpm.cpu())
    assert eager.dtype == dtype and torch.isfinite(eager).all()
    assert _rel_err(eager, ref.cpu() * 1.0001) < tol
