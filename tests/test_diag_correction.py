"""The diagonal term of the output correction (``correction='diag'``, docs/method.md#diag): the
fast path against a plain composition, the fit against a planted term, old checkpoints."""
import pytest
import torch

from latte_plugin import ops
from latte_plugin.calibration.corrections import FitOptions, LayerRecords, fit_correction
from latte_plugin.nn.install import find_latte_layers
from latte_plugin.nn.mha import swap_mha
from latte_plugin.nn.params import LatteParams
from tests.test_core_calibration import _record
from tests.toy import ToyEncoder, toy_batches


def _layer(c: int = 32, h: int = 4, seed: int = 0) -> LatteParams:
    g = torch.Generator().manual_seed(seed)
    layer = LatteParams(c, h, mode="linear")
    layer.m.fill_(0.7)
    layer.log_rho.fill_(0.3)
    layer.sigma.copy_(1 + 0.1 * torch.randn(c, generator=g))
    layer.refit_weight.copy_(torch.eye(c) + 0.05 * torch.randn(c, c, generator=g))
    layer.refit_bias.copy_(0.1 * torch.randn(c, generator=g))
    layer.refit_on.fill_(True)
    layer.diag_weight.copy_(0.2 * torch.randn(c, c, generator=g))
    layer.diag_on.fill_(True)
    return layer


def _naive(layer: LatteParams, q, k, v, key_padding_mask=None, own=True):
    """The correction written out: ``([o sigma] W^T + b + [v_own] U^T)`` on heads merged per token."""
    fq, fk = layer.features(q.double(), k.double())
    o = ops.naive_linear_attention(fq, fk, v.double(), key_padding_mask)
    b, h, n, dv = o.shape
    merge = lambda x: x.transpose(1, 2).reshape(b, n, h * dv)  # noqa: E731
    out = merge(o * layer.sigma.double().view(h, 1, dv)) @ layer.refit_weight.double().t() + layer.refit_bias.double()
    if own:
        out = out + merge(v.double()) @ layer.diag_weight.double().t()
    return out.view(b, n, h, dv).transpose(1, 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.float64, 1e-6), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("masked", [False, True])
def test_diag_term_matches_the_plain_composition(dtype, tol, masked):
    layer = _layer()
    q, k, v = (torch.randn(2, 4, 12, 8, dtype=dtype) for _ in range(3))
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 9:] = True
    mask = pad if masked else None
    got = layer.linear(q, k, v, mask).double()
    want = _naive(layer, q, k, v, mask)
    keep = ~pad[:, None, :, None].expand_as(got) if masked else torch.ones_like(got, dtype=torch.bool)
    torch.testing.assert_close(got[keep], want[keep], atol=tol, rtol=tol)
    assert layer.linear(q, k, v, mask).dtype == dtype


def test_no_diag_term_where_queries_are_not_the_keys():
    layer = _layer()
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 12, 8), torch.randn(1, 4, 12, 8)
    torch.testing.assert_close(layer.linear(q, k, v).double(), _naive(layer, q, k, v, own=False), atol=2e-4, rtol=2e-4)


def test_diag_fit_recovers_a_planted_own_value_term():
    """Targets made of the layer's own output plus a known map of each query's own value: the
    diagonal rule finds it (cross-fitted error near zero), the refit cannot."""
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    layer, rec = _record(model, toy_batches(n=4), "layers.2.attn", own_values=True)
    assert all(it.v_own is not None and it.v_own.shape == it.q.shape for it in rec.items)
    assert all(it.v_own is None for it in _record(model, toy_batches(n=1), "layers.2.attn")[1].items)  # not asked for
    c, h = layer.embed_dim, layer.num_heads
    planted = 0.5 * torch.randn(c, c, generator=torch.Generator().manual_seed(1))
    layer.m.fill_(0.7)  # the kernel scalars, kept from here on (only the correction is fitted)
    layer.log_rho.fill_(0.3)
    for it in rec.items:
        o = layer.linear(it.q.unsqueeze(0), it.k.unsqueeze(0), it.v.unsqueeze(0))[0]  # no own term: n != M
        n, dv = o.shape[1], o.shape[2]
        own = it.v_own.transpose(0, 1).reshape(n, c) @ planted.t()
        it.target = o + own.view(n, h, dv).transpose(0, 1)
    refit = fit_correction(layer, LayerRecords(rec.items), FitOptions(correction="refit"))
    diag = fit_correction(layer, LayerRecords(rec.items), FitOptions(correction="diag"))
    assert diag.correction.startswith("diag@") and bool(layer.diag_on) and bool(layer.refit_on)
    assert min(diag.choice["correction"].values()) < 0.05 * min(refit.choice["correction"].values())
    for it in rec.items[:3]:  # the fitted layer reproduces the targets (the planted map, on the values' span)
        o = layer.linear(it.q.unsqueeze(0), it.k.unsqueeze(0), it.v.unsqueeze(0))[0]
        got = layer.correct(o, it.v_own)
        err = float(((got - it.target) ** 2).sum() / (it.target ** 2).sum())
        assert err < 1e-3


def test_a_checkpoint_without_the_diag_buffers_loads_with_the_term_off():
    layer = _layer()
    state = {k: v for k, v in layer.state_dict().items() if not k.startswith("diag_")}
    fresh = LatteParams(32, 4)
    fresh.load_state_dict(state)
    assert not bool(fresh.diag_on) and torch.equal(fresh.diag_weight, torch.zeros(32, 32))
    torch.testing.assert_close(fresh.refit_weight, layer.refit_weight)


def test_diag_calibration_end_to_end_keeps_the_term_in_the_model():
    from latte_plugin.calibration.config import LatteConfig
    from latte_plugin.calibration.flow import calibrate_model

    model = ToyEncoder(depth=3).eval()
    swap_mha(model, ["layers.*.attn"])
    batches = toy_batches(n=4, tokens=24)
    cfg = LatteConfig(candidates=["layers.*.attn"], num_images=4, correction="diag", selection="score", signal=False,
                      steps=2, compensate="never")
    rep = calibrate_model(model, batches, lambda b: model(b), cfg, log=lambda s: None)
    layers = find_latte_layers(model)
    assert rep["linearized"] and all(bool(layers[n].diag_on) for n in rep["linearized"])
    assert all(rep["fit"][n]["correction"].startswith("diag@") for n in rep["linearized"])
    with torch.no_grad():
        assert torch.isfinite(model(batches[0])).all()


def test_diag_term_exports_to_onnx_and_matches_onnxruntime(tmp_path):
    from latte_plugin.export import export_onnx, max_abs_diff, run_onnx
    from latte_plugin.nn.install import set_modes

    model = ToyEncoder(depth=2).eval()
    swap_mha(model, ["layers.*.attn"])
    layers = find_latte_layers(model)
    g = torch.Generator().manual_seed(3)
    for layer in layers.values():
        layer.refit_on.fill_(True)
        layer.diag_weight.copy_(0.3 * torch.randn(layer.embed_dim, layer.embed_dim, generator=g))
        layer.diag_on.fill_(True)
    set_modes(layers, list(layers))
    path = export_onnx(model, torch.randn(2, 24, 32), str(tmp_path / "diag.onnx"), input_names=["x"],
                       output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "tokens"}})
    with torch.no_grad():
        for shape in [(2, 24, 32), (1, 37, 32)]:
            x = torch.randn(*shape)
            assert max_abs_diff([model(x)], run_onnx(path, x)) < 1e-4, shape
        for layer in layers.values():  # the term is in the graph: without it the outputs move
            layer.diag_on.fill_(False)
        assert max_abs_diff([model(x)], run_onnx(path, x)) > 1e-3


@pytest.mark.parametrize("reg", [1e-3, 1.0])
def test_diag_ridge_from_sums_matches_a_naive_augmented_least_squares(reg):
    """The closed form from summed statistics against ridge written as least squares on rows
    stacked with the penalty's: ``W`` pulled towards the identity, ``U`` towards zero, no bias penalty."""
    from latte_plugin.calibration.closed_form import correction_mse, correction_weights

    g = torch.Generator().manual_seed(5)
    c, rows = 6, 80
    o, own = torch.randn(rows, c, generator=g, dtype=torch.float64), torch.randn(rows, c, generator=g, dtype=torch.float64)
    y = o @ torch.randn(c, c, generator=g, dtype=torch.float64) + 0.5 * own + 0.1 * torch.randn(rows, c, generator=g,
                                                                                                  dtype=torch.float64)
    x = torch.cat([o, torch.ones(rows, 1, dtype=torch.float64), own], 1)
    sums = {"xtx": x.t() @ x, "xty": x.t() @ y, "yty": (y * y).sum(), "rows": torch.tensor(float(rows))}
    got = correction_weights("diag", sums, reg)
    lam = reg * float((o * o).sum(0).mean())
    pen = torch.diag(torch.tensor([1.0] * c + [0.0] + [1.0] * c, dtype=torch.float64)) * lam ** 0.5
    target = torch.cat([torch.eye(c, dtype=torch.float64), torch.zeros(c + 1, c, dtype=torch.float64)]) * lam ** 0.5
    want = torch.linalg.lstsq(torch.cat([x, pen]), torch.cat([y, target])).solution
    torch.testing.assert_close(got, want, atol=1e-8, rtol=1e-8)
    mse = float(((x @ got - y) ** 2).mean())
    assert correction_mse(got, sums) == pytest.approx(mse, rel=1e-9)
    refit = correction_weights("refit", sums, reg)  # the refit sees only [o, 1]
    assert refit.shape == (c + 1, c) and correction_mse(refit, sums) > mse


def _own_token_model(scale: float = 4.0) -> ToyEncoder:
    """A toy whose attention rows peak on each query's own token (q = k = scale * x, v = x): the
    case a second-order kernel cannot hold and the diagonal term can."""
    model = ToyEncoder(depth=3).eval()
    c = model.head.in_features
    with torch.no_grad():
        for block in model.layers:
            w = block.attn.in_proj_weight
            w[:c].copy_(scale * torch.eye(c))
            w[c:2 * c].copy_(scale * torch.eye(c))
            w[2 * c:].copy_(torch.eye(c))
            block.attn.in_proj_bias.zero_()
    swap_mha(model, ["layers.*.attn"])
    return model


@pytest.mark.parametrize("previous", [False, True])
def test_the_defaults_judge_diag_as_a_rule_and_take_it_where_it_clearly_wins(previous):
    from latte_plugin.calibration.config import PREVIOUS_CORRECTION_RULES, LatteConfig
    from latte_plugin.calibration.flow import calibrate_model

    model = _own_token_model()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(2, 24, 32, generator=g) for _ in range(8)]  # independent tokens: sharp own-token rows
    rules = {"correction_rules": PREVIOUS_CORRECTION_RULES} if previous else {}
    cfg = LatteConfig(candidates=["layers.*.attn"], num_images=8, signal=False, steps=2, **rules)
    rep = calibrate_model(model, batches, lambda b: model(b), cfg, log=lambda s: None)
    losses, chosen = rep["selection"]["comparison"]["losses"], rep["selection"]["configuration"]
    layers = find_latte_layers(model)
    if previous:  # the rules before diag joined: no diag pair, no own values recorded, the reference kept
        assert not any(n.endswith("+diag") for n in losses) and chosen.startswith("greedy+refit")
        assert not any(bool(layers[n].diag_on) for n in rep["linearized"])
    else:  # diag judged on the same sets as every rule; here its loss is a fraction of the reference's
        assert {"greedy+diag", "score+diag"} <= set(losses) and losses["greedy+diag"] < 0.5 * losses["greedy+refit"]
        assert chosen.startswith("greedy+diag") and all(bool(layers[n].diag_on) for n in rep["linearized"])


def test_correction_rules_outside_the_corrections_are_refused_in_one_line():
    from latte_plugin.calibration.config import LatteConfig

    with pytest.raises(ValueError, match=r"correction_rules \['refit', 'diagonal'\]: give one or more of"):
        LatteConfig(correction_rules=("refit", "diagonal"))
