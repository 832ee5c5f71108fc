"""RT-DETR in detectron2 without mmdet or mmcv: ``LatteRTDETR`` wraps HF's
``RTDetrForObjectDetection`` directly, with the same checkpoint keys and outputs as the mmdet
``HFRTDETR``. Needs detectron2 and transformers only (the mmdet comparison also needs mmdet)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import ROOT, require

require("detectron2")
require("detectron2._C")

TINY_JSON = os.path.join(ROOT, "configs", "hf", "rtdetr_tiny.json")
TINY_MMDET = os.path.join(ROOT, "configs", "mmdet", "rtdetr_tiny_latte_synthetic.py")


def _inputs(seed: int, shapes=((100, 130), (96, 70))):
    g = torch.Generator().manual_seed(seed)
    return [{"image": torch.randint(0, 255, (3, h, w), generator=g, dtype=torch.uint8), "height": 2 * h,
             "width": 2 * w, "image_id": i} for i, (h, w) in enumerate(shapes)]


def test_postprocess_equals_its_naive_reference():
    from latte_plugin.hf.rtdetr import naive_rtdetr_postprocess, rtdetr_postprocess

    g = torch.Generator().manual_seed(0)
    logits, boxes = torch.randn(3, 12, 5, generator=g), torch.rand(3, 12, 4, generator=g)
    hw = [(64, 96), (32, 32), (128, 40)]
    for (s, l, b), (rs, rl, rb) in zip(rtdetr_postprocess(logits, boxes, hw, 7),
                                       naive_rtdetr_postprocess(logits, boxes, hw, 7)):
        torch.testing.assert_close(s, rs)
        assert torch.equal(l, rl)
        torch.testing.assert_close(b, rb, atol=1e-5, rtol=1e-6)


def test_latte_rtdetr_equals_the_mmdet_model_on_one_checkpoint():
    """Same keys; the same boxes, scores and labels as mmdet's HFRTDETR behind ``MMDetDetector``,
    on a batch of two images that need padding and rescaling."""
    require("mmdet.models")
    from latte_plugin.detectron2 import LatteRTDETR, MMDetDetector

    torch.manual_seed(0)
    ours = LatteRTDETR(hf_config=TINY_JSON, max_per_img=30).eval()
    ref = MMDetDetector(TINY_MMDET).eval()
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    with torch.no_grad():
        a, b = ours(_inputs(0)), ref(_inputs(0))
        for x, y in zip(ours.tensor_forward(_inputs(1)), ref.tensor_forward(_inputs(1))):
            torch.testing.assert_close(x, y)
    for x, y in zip(a, b):
        x, y = x["instances"], y["instances"]
        assert x.image_size == y.image_size
        torch.testing.assert_close(x.pred_boxes.tensor, y.pred_boxes.tensor)
        torch.testing.assert_close(x.scores, y.scores)
        assert torch.equal(x.pred_classes, y.pred_classes)


def test_latte_rtdetr_trains_one_step():
    from detectron2.structures import Boxes, Instances

    from latte_plugin.detectron2 import LatteRTDETR

    model = LatteRTDETR(hf_config=TINY_JSON).train()
    batch = _inputs(2)
    for d in batch:
        inst = Instances(tuple(d["image"].shape[-2:]))
        inst.gt_boxes, inst.gt_classes = Boxes(torch.tensor([[5.0, 6.0, 40.0, 50.0]])), torch.tensor([1])
        d["instances"] = inst
    loss = model(batch)["loss"]
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.hf.parameters())


BLOCKED_RUN = textwrap.dedent('''
    import importlib.abc, json, sys
    BLOCKED = ("mmdet", "mmcv", "mmengine")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")

    sys.meta_path.insert(0, Block())
    import torch
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import LazyConfig, instantiate
    from detectron2.evaluation import inference_on_dataset
    import latte_plugin.detectron2 as d2p
    from latte_plugin.nn import find_latte_layers

    from detectron2.modeling import META_ARCH_REGISTRY
    assert META_ARCH_REGISTRY.get("LatteRTDETR") is d2p.LatteRTDETR
    root, cfg_path, ckpt, out = sys.argv[1:5]
    train, val = d2p.register_synthetic(root, prefix="latte_nomm")
    cfg = LazyConfig.apply_overrides(LazyConfig.load(cfg_path), [
        f"dataloader.test.dataset.names={val}", f"dataloader.evaluator.dataset_name={val}",
        f"dataloader.evaluator.output_dir={out}", f"model.calibration_loader.dataset.names={train}",
        "model.latte.num_images=4", "model.latte.steps=2", "model.latte.selection=score",
        "model.latte.correction=sigma", "model.latte.compensate=never", "model.latte.signal=False"])
    model = instantiate(cfg.model)
    DetectionCheckpointer(model).load(ckpt)
    model.eval()
    res = inference_on_dataset(model, instantiate(cfg.dataloader.test), instantiate(cfg.dataloader.evaluator))
    layers = find_latte_layers(model)
    print(json.dumps({"AP": res["bbox"]["AP"], "calibrated": all(bool(l.calibrated) for l in layers.values()),
                      "linear": sum(l.mode == "linear" for l in layers.values()), "layers": len(layers),
                      "mm": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
''')


@pytest.mark.timeout(600)
def test_latte_rtdetr_registers_calibrates_and_evaluates_with_mmdet_and_mmcv_unimportable(tmp_path):
    """The embedded RT-DETR LazyConfig and checkpoint in a process where importing mmdet, mmcv or
    mmengine raises: it builds, loads, calibrates itself at the first evaluation forward and
    COCOEvaluator reports its AP."""
    import json

    from latte_plugin.data.synthetic import make_synthetic_coco

    root = make_synthetic_coco(str(tmp_path / "data"), num_train=6, num_val=4, size=128, seed=0)
    script = tmp_path / "run.py"
    script.write_text(BLOCKED_RUN)
    cfg = os.path.join(ROOT, "configs", "detectron2", "embedded", "rtdetr_r18_synthetic_latte.py")
    ckpt = os.path.join(ROOT, "checkpoints", "rtdetr_r18_synthetic.pth")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(script), root, cfg, ckpt, str(tmp_path / "eval")],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mm"] == [] and result["calibrated"] and result["layers"] == 7 and result["linear"] == 5
    assert result["AP"] == result["AP"] and result["AP"] > 0  # a number, and the trained model finds objects


def test_detectron2_adapter_detects_with_the_models_own_postprocessing():
    """Detectron2Adapter.detect() (what target= compares) gives the boxes, scores and classes the
    meta-architecture returns, without triggering its self-calibration."""
    from latte_plugin.detectron2 import LatteRTDETR
    from latte_plugin.detectron2.calibrate import ADAPTER

    torch.manual_seed(0)
    model = LatteRTDETR(hf_config=TINY_JSON, max_per_img=30).eval()
    with torch.no_grad():
        dets, out = ADAPTER.detect(model)(_inputs(0)), model(_inputs(0))
    assert len(dets) == len(out) == 2
    for (boxes, scores, labels), r in zip(dets, out):
        assert torch.equal(boxes, r["instances"].pred_boxes.tensor) and torch.equal(scores, r["instances"].scores)
        assert torch.equal(labels, r["instances"].pred_classes)
