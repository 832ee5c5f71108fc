"""Core kernels against their references, over shapes, dtypes and masks."""
import math

import pytest
import torch

from latte_plugin import ops as K
from tests.conftest import qkv

SHAPES = [(1, 1, 1, 1, 4), (2, 4, 37, 37, 16), (3, 2, 5, 64, 8), (1, 8, 128, 96, 32)]


def _padding(b, m, frac=0.3):
    kpm = torch.zeros(b, m, dtype=torch.bool)
    for i in range(b):
        cut = m - int(frac * m * i / max(b - 1, 1))
        kpm[i, max(cut, 1):] = True
    return kpm


@pytest.mark.parametrize("b,h,n,m,d", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_fast_matches_naive(b, h, n, m, d, masked):
    q, k, v = qkv(b, h, n, m, d)
    kpm = _padding(b, m) if masked else None
    torch.testing.assert_close(K.softmax_attention(q, k, v, kpm), K.naive_softmax_attention(q, k, v, kpm),
                               atol=1e-5, rtol=1e-5)


def test_softmax_naive_matches_torch_mha_math():
    q, k, v = qkv(2, 4, 20, 20, 8)
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
    torch.testing.assert_close(K.naive_softmax_attention(q, k, v), ref, atol=1e-6, rtol=1e-6)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = qkv(2, 2, 6, 6, 4)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True
    for fn in (K.softmax_attention, K.naive_softmax_attention):
        out = fn(q, k, v, kpm)
        assert torch.isfinite(out).all()
        assert (out[1] == 0).all()
    fq, fk = K.variant_features(q, k, "latte", 0.5, 1.0, 1.0, 1.0, 1.0)
    for fn in (K.linear_attention, K.naive_linear_attention):
        out = fn(fq, fk, v, kpm)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


@pytest.mark.parametrize("m", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("d", [1, 4, 16])
def test_exact_taylor_map_identity_with_kappa(m, d):
    q, k, _ = qkv(2, 3, 11, 13, d, dtype=torch.float64)
    alpha = 1 - m**2
    x = q @ k.transpose(-1, -2) / math.sqrt(d)
    phi_q, phi_k = K.taylor_exact_feature_map(q, m), K.taylor_exact_feature_map(k, m)
    assert phi_q.shape[-1] == (d + 1) ** 2 + 1
    torch.testing.assert_close(phi_q @ phi_k.transpose(-1, -2), K.taylor_kernel(x, alpha), atol=1e-10, rtol=1e-10)
    assert (K.taylor_kernel(x, alpha) >= 1).all()


def test_taylor_kernel_is_second_order_exp_around_alpha():
    alpha = 0.4
    x = torch.linspace(-1, 2, 7, dtype=torch.float64)
    taylor = math.exp(alpha) * (1 + (x - alpha) + (x - alpha) ** 2 / 2)
    torch.testing.assert_close(math.exp(alpha) / 2 * K.taylor_kernel(x, alpha), taylor)


def test_psi_diag_is_the_folded_diagonal():
    x = torch.randn(5, 16, dtype=torch.float64)
    m, d = 0.7, 16
    expect = x**2 / math.sqrt(d) + 2 * m * x / d**0.25 + m**2
    torch.testing.assert_close(K.psi_diag(x, m), expect)


@pytest.mark.parametrize("dq,dk", [(1.0, 1.0), (2.5, 0.3)])
def test_jpn_joint_equals_factorised(dq, dk):
    q, k, _ = qkv(2, 3, 9, 14, 8, dtype=torch.float64)
    fq, fk = K.psi_diag(q, 0.8), K.psi_diag(k, 0.8)
    joint = K.naive_jpn_similarity(fq, fk, dq, dk)
    fact = K.jpn_normalize(fq, dq) @ K.jpn_normalize(fk, dk).transpose(-1, -2)
    torch.testing.assert_close(joint, fact, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("variant", K.VARIANTS)
def test_gauge_invariance(variant):
    """O depends on (delta_q, delta_k, beta_q, beta_k) only through rho = dq dk / (bq bk)."""
    q, k, v = qkv(2, 2, 17, 17, 8, dtype=torch.float64)
    a = K.linear_attention(*K.variant_features(q, k, variant, 0.6, 2.0, 3.0, 1.0, 1.0), v)
    b = K.linear_attention(*K.variant_features(q, k, variant, 0.6, 4.0, 6.0, 2.0, 2.0), v)
    c = K.linear_attention(*K.variant_features(q, k, variant, 0.6, 6.0, 1.0, 1.0, 1.0), v)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-10)
    d = K.linear_attention(*K.variant_features(q, k, variant, 0.6, 1.0, 1.0, 1.0, 1.0), v)
    assert not torch.allclose(a, d)  # a different rho really changes the output


@pytest.mark.parametrize("variant", K.VARIANTS)
@pytest.mark.parametrize("b,h,n,m,d", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_linear_fast_matches_naive(variant, b, h, n, m, d, masked):
    q, k, v = qkv(b, h, n, m, d)
    kpm = _padding(b, m) if masked else None
    fq, fk = K.variant_features(q, k, variant, 0.7, 1.5, 1.5, 1.0, 1.0)
    torch.testing.assert_close(K.linear_attention(fq, fk, v, kpm), K.naive_linear_attention(fq, fk, v, kpm),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("variant", K.VARIANTS)
def test_padded_keys_have_no_influence(variant):
    q, k, v = qkv(2, 2, 12, 12, 8)
    kpm = _padding(2, 12, 0.5)
    fq, fk = K.variant_features(q, k, variant, 0.5, 1.2, 1.2, 1.0, 1.0)
    base = K.linear_attention(fq, fk, v, kpm)
    k2, v2 = k.clone(), v.clone()
    k2[kpm[:, None, :, None].expand_as(k2)] = 1e4
    v2[kpm[:, None, :, None].expand_as(v2)] = -7.0
    fq2, fk2 = K.variant_features(q, k2, variant, 0.5, 1.2, 1.2, 1.0, 1.0)
    assert torch.equal(K.linear_attention(fq2, fk2, v2, kpm), base)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_low_precision_accumulates_in_float32(dtype, tol):
    q, k, v = qkv(1, 2, 4096, 4096, 16)
    fq, fk = K.variant_features(q, k, "latte", 0.7, 1.0, 1.0, 1.0, 1.0)
    ref = K.linear_attention(fq, fk, v)
    low = K.linear_attention(fq.to(dtype), fk.to(dtype), v.to(dtype))
    assert low.dtype == dtype and torch.isfinite(low).all()
    torch.testing.assert_close(low.float(), ref, atol=tol, rtol=tol)


def test_attention_mask_rejected_or_honoured():
    q, k, v = qkv(1, 2, 5, 5, 4)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    assert K.bool_attn_mask(torch.zeros(5, 5, dtype=torch.bool)) is None  # masks nothing
    assert K.bool_attn_mask(torch.zeros(5, 5)) is None
    additive = torch.zeros(5, 5).masked_fill(causal, float("-inf"))
    assert torch.equal(K.bool_attn_mask(additive), causal[None, None])
    assert torch.equal(K.bool_attn_mask(torch.zeros(5, 5).masked_fill(causal, torch.finfo(torch.float32).min)),
                       causal[None, None])
    with pytest.raises(ValueError, match="additive attention bias"):
        K.bool_attn_mask(torch.randn(5, 5))
    # kernel attention under a general mask == the explicit masked, normalised score matrix
    fq, fk = K.variant_features(q, k, "latte", 0.7, 1.0, 1.0, 1.0, 1.0)
    s = (fq @ fk.transpose(-1, -2)).masked_fill(causal, 0.0)
    torch.testing.assert_close(K.naive_linear_attention(fq, fk, v, attn_mask=causal), (s / s.sum(-1, keepdim=True)) @ v)
    out = K.naive_softmax_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :])  # first query sees only key 0
    torch.testing.assert_close(K.softmax_attention(q, k, v, attn_mask=causal), out, atol=1e-6, rtol=1e-6)


def test_unknown_variant():
    q, k, _ = qkv(1, 1, 3, 3, 4)
    with pytest.raises(ValueError, match="unknown LATTE variant 'nope'"):
        K.variant_features(q, k, "nope", 1.0, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("b,h,n,m,d", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2)])
def test_fused_latte_matches_reference(b, h, n, m, d, masked, dtype, tol):
    q, k, v = qkv(b, h, n, m, d)
    kpm = _padding(b, m) if masked else None
    mm, dq, dk = 0.8, 2.0, 1.5
    ref = K.linear_attention(*K.variant_features(q.double(), k.double(), "latte", mm, dq, dk, 1.0, 1.0), v.double(), kpm)
    out = K.fused_latte_attention(q.to(dtype), k.to(dtype), v.to(dtype), mm, dq * dk, kpm)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_uniform_attention_is_masked_mean():
    _, _, v = qkv(2, 2, 5, 7, 4)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 3:] = True
    out = K.uniform_attention(v, kpm, num_queries=5)
    torch.testing.assert_close(out[0, :, 2], v[0].mean(dim=-2))
    torch.testing.assert_close(out[1, :, 4], v[1, :, :3].mean(dim=-2))


@pytest.mark.timeout(300)
def test_compiled_fused_path_matches_eager_and_reference(monkeypatch):
    """torch.compile of the fused path (benchmarks' --compile) gives the eager results, masks included."""
    q, k, v = qkv(2, 4, 37, 37, 16)
    kpm = torch.zeros(2, 37, dtype=torch.bool)
    kpm[1, 30:] = True
    m, rho = torch.full((4, 1, 1), 0.7), torch.full((4, 1, 1), 3.0)
    eager = K.fused_latte_attention(q, k, v, m, rho, kpm)
    compiled = K.compiled_fused_latte_attention()(q, k, v, m, rho, kpm)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    ref = K.linear_attention(*K.variant_features(q, k, "latte", m, rho ** 0.5, rho ** 0.5, 1.0, 1.0), v, kpm)
    torch.testing.assert_close(compiled, ref, atol=1e-4, rtol=1e-4)
    # a calibrated layer takes it under LATTE_KERNEL=compiled (the benchmarks' CPU setting), read
    # once when the layer is built: a later change of the variable does not reach it
    from latte_plugin.nn.params import LatteParams
    from latte_plugin.ops import latte as latte_ops

    monkeypatch.setenv("LATTE_KERNEL", "compiled")
    layer = LatteParams(64, 4, mode="linear")
    monkeypatch.setenv("LATTE_KERNEL", "eager")
    assert layer.backend == "compiled" and LatteParams(64, 4).backend == "eager"
    layer.m.fill_(0.7)
    layer.log_rho.fill_(math.log(3.0))
    real, calls = latte_ops._COMPILED, []  # built above
    monkeypatch.setattr(latte_ops, "_COMPILED", lambda *a: calls.append(1) or real(*a))
    torch.testing.assert_close(layer.attend(q, k, v, kpm), eager, atol=1e-5, rtol=1e-5)
    assert calls == [1]
