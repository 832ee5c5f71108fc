"""The signal measure: a layer the network ignores gives ~0, a layer it needs gives > 0, against
a plain reference; modes are restored."""
import torch

from latte_plugin.adapter import swap_attention
from latte_plugin.nn.install import find_latte_layers
from latte_plugin.calibration.signal import attention_signal, naive_attention_signal
from tests.toy import ToyEncoder, toy_batches


def _model():
    model = ToyEncoder(depth=3).eval()
    swap_attention(model, ["layers.*.attn"])
    with torch.no_grad():  # layer 1's attention branch is multiplied by zero: the network ignores it
        model.layers[1].attn.out_proj.weight.zero_()
        model.layers[1].attn.out_proj.bias.zero_()
    return model


def test_an_ignored_layer_scores_zero_and_a_needed_one_does_not():
    model = _model()
    layers = find_latte_layers(model)
    batches = toy_batches(n=3)
    layers["layers.2.attn"].mode = "linear"
    sig = attention_signal(layers, batches, lambda x: model(x))
    assert sig["layers.1.attn"] < 1e-12
    assert sig["layers.0.attn"] > 1e-3 and sig["layers.2.attn"] > 1e-3
    assert layers["layers.2.attn"].mode == "linear" and layers["layers.0.attn"].mode == "exact"


def test_the_signal_equals_its_naive_reference_and_sums_across_processes():
    model = _model()
    layers = find_latte_layers(model)
    x = torch.cat(toy_batches(n=2))

    def whole(name, uniform):
        for n, layer in layers.items():
            layer.mode = "uniform" if (uniform and n == name) else "exact"
        with torch.no_grad():
            return model(x)

    want = naive_attention_signal(whole, list(layers))
    got = attention_signal(layers, [x[:2], x[2:]], lambda b: model(b))
    for name in layers:
        assert abs(got[name] - want[name]) <= 1e-9 + 1e-6 * want[name], name
    doubled = attention_signal(layers, [x], lambda b: model(b), all_reduce=lambda t: t.mul_(2))
    assert abs(doubled["layers.0.attn"] - want["layers.0.attn"]) <= 1e-6 * want["layers.0.attn"]


def test_the_calibration_report_holds_the_signal_of_every_candidate():
    from latte_plugin.calibration.flow import calibrate_model
    from latte_plugin.calibration.config import LatteConfig

    model = _model()
    report = calibrate_model(model, toy_batches(n=4), lambda x: model(x),
                             LatteConfig(selection="score", correction="sigma", compensate="never", holdout=0.0,
                                         num_linear=2, steps=2),
                             log=lambda s: None)
    assert set(report["signal"]) == set(report["candidates"])
    assert report["signal"]["layers.1.attn"] < 1e-12 < 1e-3 < report["signal"]["layers.0.attn"]
    # measured on the exact model: the hybrid the calibration leaves is untouched
    assert {n for n, layer in find_latte_layers(model).items() if layer.mode == "linear"} == set(report["linearized"])


def test_attention_entropy_is_one_for_uniform_and_near_zero_for_one_key_per_query():
    from latte_plugin.calibration.signal import attention_entropy

    k = torch.randn(2, 3, 9, 8)
    assert abs(attention_entropy(torch.zeros(2, 3, 5, 8), k) - 1.0) < 1e-12  # equal scores: uniform
    sharp = torch.eye(8)[None, None] * 100.0  # each query matches one key, by far
    assert attention_entropy(sharp, sharp) < 1e-6
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 4:] = True  # padded keys neither weigh nor count: still uniform over the 4 valid ones
    assert abs(attention_entropy(torch.zeros(2, 3, 5, 8), k, kpm) - 1.0) < 1e-12
    # the same figure as an explicit row-by-row computation
    q = torch.randn(1, 3, 4, 8)
    p = torch.softmax(q @ k[:1].transpose(-1, -2) / 8 ** 0.5, -1).double()
    want = float((-(p * p.log()).sum(-1) / torch.log(torch.tensor(9.0, dtype=torch.float64))).mean())
    assert abs(attention_entropy(q, k[:1]) - want) < 1e-6


def test_attention_sharpness_reads_each_exact_layer_and_restores_modes():
    from latte_plugin.calibration.signal import attention_sharpness

    model = _model()
    layers = find_latte_layers(model)
    layers["layers.2.attn"].mode = "linear"
    got = attention_sharpness(layers, toy_batches(n=2), lambda x: model(x))
    assert set(got) == set(layers) and all(0.0 < v <= 1.0 for v in got.values())
    assert layers["layers.2.attn"].mode == "linear" and not any(layer.tapped for layer in layers.values())
