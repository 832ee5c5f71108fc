"""Property tests (hypothesis) over shapes, scales, dtypes and masks, on every variant."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from latte_plugin.nn.params import LatteParams
from latte_plugin.ops.latte import VARIANTS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def cases(draw):
    b = draw(st.integers(1, 3))
    h = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([1, 4, 8, 16]))
    n = draw(st.integers(1, 40))
    m = draw(st.integers(1, 40))
    scale = draw(st.sampled_from([1e-3, 1e-1, 1.0, 10.0, 1e3]))
    dtype = draw(st.sampled_from(DTYPES))
    variant = draw(st.sampled_from(VARIANTS))
    pad = draw(st.lists(st.integers(0, m), min_size=b, max_size=b))  # padded keys per image
    seed = draw(st.integers(0, 2**16))
    alpha = draw(st.floats(-5.0, 0.999))
    log_rho = draw(st.floats(-5.0, 15.0))
    return b, h, d, n, m, scale, dtype, variant, pad, seed, alpha, log_rho


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_linear_attention_is_finite_and_ignores_padded_keys(case):
    b, h, d, n, m, scale, dtype, variant, pad, seed, alpha, log_rho = case
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, n, d, generator=g) * scale).to(dtype)
    k = (torch.randn(b, h, m, d, generator=g) * scale).to(dtype)
    v = torch.randn(b, h, m, d, generator=g).to(dtype)
    kpm = torch.zeros(b, m, dtype=torch.bool)
    for i, p in enumerate(pad):
        if p:
            kpm[i, m - p:] = True
    layer = LatteParams(h * d, h, variant=variant, mode="linear")
    layer.set_alpha(alpha)
    layer.log_rho.fill_(log_rho)
    out = layer.attend(q, k, v, kpm)
    assert out.dtype == dtype and out.shape == (b, h, n, d)
    assert torch.isfinite(out).all(), (variant, dtype, scale)
    # rows whose keys are all padded are defined as zeros
    for i, p in enumerate(pad):
        if p == m:
            assert (out[i] == 0).all()
    # changing the padded keys' content changes no output bit
    k2, v2 = k.clone(), v.clone()
    k2[kpm[:, None, :, None].expand_as(k2)] = 7.0
    v2[kpm[:, None, :, None].expand_as(v2)] = -3.0
    assert torch.equal(layer.attend(q, k2, v2, kpm), out)
