"""ONNX export of the calibrated hybrid: standard operators only, onnxruntime equal to the
torch model within 1e-4 over token counts, masks and both embedded detector families (on the
detectors' val images with the queries matched: RT-DETR's top-k may swap two nearly tied
queries), and the export tool's CocoMetric through onnxruntime equal to the torch model's.
``pytest -k onnx``."""
import os

import pytest
import torch

from tests.conftest import ROOT, require, tiny_cfg
from tests.toy import ToyEncoder, toy_batches

from latte_plugin import linearize
from latte_plugin.nn.install import find_latte_layers
from latte_plugin.export import STANDARD_DOMAINS, export_onnx, max_abs_diff, onnx_ops, run_onnx

TOL = 1e-4


@pytest.fixture(scope="module")
def calibrated_toy():
    model = ToyEncoder().eval()
    linearize(model, toy_batches(6), candidates=["layers.*.attn"], ratio=0.67, steps=5, log=lambda s: None,
              progress=False, greedy_images=2)
    return model


def test_onnx_hybrid_matches_onnxruntime_over_token_counts_and_batches(calibrated_toy, tmp_path):
    path = export_onnx(calibrated_toy, torch.randn(2, 48, 32), str(tmp_path / "toy.onnx"), input_names=["x"],
                       output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "tokens"}})
    assert {d for d, _ in onnx_ops(path)} <= set(STANDARD_DOMAINS)
    modes = [layer.mode for layer in find_latte_layers(calibrated_toy).values()]
    assert modes.count("linear") == 4  # the hybrid, not the exact model
    with torch.no_grad():
        for shape in [(2, 48, 32), (1, 97, 32), (3, 5, 32)]:
            x = torch.randn(*shape)
            assert max_abs_diff([calibrated_toy(x)], run_onnx(path, x)) < TOL, shape


def test_onnx_key_padding_mask_is_honoured(calibrated_toy, tmp_path):
    x, kpm = torch.randn(2, 40, 32), torch.zeros(2, 40, dtype=torch.bool)
    kpm[1, 30:] = True
    path = export_onnx(calibrated_toy, (x, kpm), str(tmp_path / "kpm.onnx"), input_names=["x", "kpm"],
                       dynamic_axes={"x": {1: "tokens"}, "kpm": {1: "tokens"}})
    with torch.no_grad():
        ref = calibrated_toy(x, kpm)
        assert max_abs_diff([ref], run_onnx(path, x, kpm)) < TOL
        # the padded keys matter: the same graph without them gives other outputs
        assert max_abs_diff([ref], run_onnx(path, x, torch.zeros_like(kpm))) > 1e-3


def test_onnx_dynamic_mode_exports_the_linear_path_with_a_warning(calibrated_toy, tmp_path):
    layers = find_latte_layers(calibrated_toy)
    name = next(n for n, layer in layers.items() if layer.mode == "linear")
    layers[name].mode = "dynamic"
    layers[name].threshold.fill_(10_000)  # softmax at every size seen here
    x = torch.randn(1, 48, 32)
    try:
        with pytest.warns(UserWarning, match="linear path"):
            path = export_onnx(calibrated_toy, x, str(tmp_path / "dyn.onnx"))
        assert layers[name].mode == "dynamic"  # restored
        with torch.no_grad():
            layers[name].mode = "linear"
            linear = calibrated_toy(x)
        assert max_abs_diff([linear], run_onnx(path, x)) < TOL
    finally:
        layers[name].mode = "linear"


def test_onnx_query_matching_sees_a_swap_and_nothing_else():
    from latte_plugin.export import query_matched_diff

    logits, boxes = torch.randn(2, 6, 3), torch.rand(2, 6, 4)
    swapped = [t.clone() for t in (logits, boxes)]
    for t in swapped:
        t[1, [2, 4]] = t[1, [4, 2]]
    assert query_matched_diff((logits, boxes), swapped) == (0.0, True)
    assert query_matched_diff((logits, boxes), (logits, boxes)) == (0.0, False)
    diff, _ = query_matched_diff((logits, boxes), (logits + 1e-3, boxes))
    assert abs(diff - 1e-3) < 1e-6
    # a query lost to a duplicate of another is matched one-to-one: it shows as its distance to
    # what is left (>= the distance to its nearest other query), never as a match
    lost = query_matched_diff((logits, boxes), (logits[:, [0, 0, 2, 3, 4, 5]], boxes[:, [0, 0, 2, 3, 4, 5]]))[0]
    both = torch.cat([logits, boxes], -1)
    nearest = min(float((both[b, 1] - both[b, j]).abs().max()) for b in range(2) for j in (0, 2, 3, 4, 5))
    assert lost >= nearest > 1e-2


def test_onnx_export_refuses_an_old_opset(calibrated_toy, tmp_path):
    with pytest.raises(ValueError, match="opset 13 is too old"):
        export_onnx(calibrated_toy, torch.randn(1, 8, 32), str(tmp_path / "old.onnx"), opset=13)
    assert not os.path.exists(tmp_path / "old.onnx")


EMBEDDED = {"cond_detr": ("cond_detr_r18_synthetic_latte.py", "cond_detr_r18_synthetic.pth"),
            "rtdetr": ("rtdetr_r18_synthetic_latte.py", "rtdetr_r18_synthetic.pth")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_onnx_export_tool_on_the_embedded_models_gives_the_torch_map(synthetic_data, tmp_path, name):
    """tools/calibrate.py on the committed checkpoint (a few images), then tools/export_onnx.py
    --eval: onnxruntime's raw outputs equal torch's within 1e-4 on every val image with the
    queries matched, and position by position on every image where no two nearly tied queries
    swapped places (RT-DETR's top-k; none may on the DETR); both go through the same
    post-processing to the same CocoMetric mAP; the exact baseline exports too."""
    require("mmdet.models")
    from latte_plugin.cli import calibrate as calibrate_tool
    from latte_plugin.cli import export_onnx as export_tool

    config, ckpt = EMBEDDED[name]
    cfg = tiny_cfg(synthetic_data, str(tmp_path / "w"), os.path.join(ROOT, "configs", "mmdet", "embedded", config),
                   num_images=4, steps=2, selection="score", correction="refit", compensate="never", signal=False)
    cfg_path = str(tmp_path / f"{name}.py")
    cfg.dump(cfg_path)
    report = calibrate_tool.main([cfg_path, "--checkpoint", os.path.join(ROOT, "checkpoints", ckpt),
                                  "--work-dir", str(tmp_path / "cal")])
    out = export_tool.main([cfg_path, report["paths"]["checkpoint"], "--out", str(tmp_path / "m.onnx"), "--eval"])
    assert out["linear"] == report["linearized"] and len(out["linear"]) > 0
    assert out["max_abs_diff"] < TOL and out["metrics"]["max_query_matched_diff_val"] < TOL
    m = out["metrics"]
    if name == "cond_detr" or m["images_with_reordered_queries"] == 0:  # no top-k: positions are queries
        assert m["images_with_reordered_queries"] == 0 and m["max_abs_diff_val"] < TOL
    assert round(m["torch"]["bbox_mAP"], 3) == round(m["onnxruntime"]["bbox_mAP"], 3) and m["torch"]["bbox_mAP"] > 0
    exact = export_tool.main([cfg_path, report["paths"]["checkpoint"], "--out", str(tmp_path / "exact.onnx"),
                              "--exact"])
    assert exact["linear"] == [] and exact["max_abs_diff"] < TOL
