"""RT-DETR in MMDetection: HF's RTDetrForObjectDetection wrapped as the ``HFRTDETR`` detector.

The wrapper must equal HF on the same weights (boxes and scores within 1e-5), load an HF
checkpoint directory offline, run mmdet's pipeline / Runner / CocoMetric unchanged, and take
LATTE on its 7 attention layers from the config."""
import copy
import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, require, tiny_cfg

require("mmcv.ops")
require("mmdet.models")
require("transformers")
import latte_plugin.mmdet  # noqa: E402,F401
from latte_plugin.nn.install import find_latte_layers, set_modes

TINY_RTDETR = os.path.join(ROOT, "configs", "mmdet", "rtdetr_tiny_latte_synthetic.py")
EMBEDDED_RTDETR = os.path.join(ROOT, "configs", "mmdet", "embedded", "rtdetr_r18_synthetic.py")


def _cfg(data_root=None, work_dir=None, **hook):
    return tiny_cfg(data_root, work_dir, TINY_RTDETR, **hook)


def _hf_model(cfg):
    from transformers import RTDetrConfig, RTDetrForObjectDetection

    torch.manual_seed(0)
    from latte_plugin.hf.detectors import load_config_kwargs

    return RTDetrForObjectDetection(RTDetrConfig(**load_config_kwargs(cfg.model.hf_config))).eval()


def test_hfrtdetr_equals_hf_reference_on_the_same_weights(tmp_path):
    """Same image file -> mmdet pipeline + HFRTDETR vs HF image processor + model + post-processing."""
    import cv2
    from mmcv.transforms import Compose
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from transformers import RTDetrImageProcessor

    register_all_modules()
    cfg = _cfg()
    hf = _hf_model(cfg)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(str(hf_dir))  # config.json + model.safetensors
    assert (hf_dir / "model.safetensors").exists()

    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.pop("hf_config")
    model_cfg["pretrained"] = str(hf_dir)  # offline load of an HF checkpoint directory
    det = MODELS.build(model_cfg).eval()

    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, size=(256, 256, 3), dtype=np.uint8)  # network size: no resize on either side
    path = str(tmp_path / "img.png")
    cv2.imwrite(path, img)
    pipeline = Compose([dict(type="LoadImageFromFile"),
                        dict(type="Resize", scale=(256, 256), keep_ratio=False),
                        dict(type="PackDetInputs", meta_keys=("img_id", "img_path", "ori_shape", "img_shape",
                                                              "scale_factor"))])
    data = pipeline(dict(img_path=path, img_id=0))
    batch = dict(inputs=[data["inputs"]], data_samples=[data["data_samples"]])
    with torch.no_grad():
        ours = det.test_step(batch)[0].pred_instances

        proc = RTDetrImageProcessor(do_resize=False, do_normalize=False)
        inputs = proc(images=img[:, :, ::-1].copy(), return_tensors="pt")  # PIL-style RGB
        out = hf(**inputs)
        ref = proc.post_process_object_detection(out, threshold=0.0, target_sizes=[(256, 256)])[0]
    k = len(ours.scores)
    assert k == cfg.model.test_cfg.max_per_img
    torch.testing.assert_close(ours.scores, ref["scores"][:k], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.bboxes, ref["boxes"][:k], atol=1e-5, rtol=0)
    assert torch.equal(ours.labels, ref["labels"][:k])


def test_rtdetr_candidates_and_exact_mode_is_unchanged():
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample

    from latte_plugin.calibration.config import LatteConfig
    from latte_plugin.mmdet import install_latte_cores
    from latte_plugin.mmdet.rtdetr import RTDETR_CANDIDATES

    cfg = _cfg()
    torch.manual_seed(0)
    det = MODELS.build(copy.deepcopy(cfg.model)).eval()
    x = torch.rand(2, 3, 128, 128)
    ds = [DetDataSample(metainfo=dict(img_shape=(128, 128), batch_input_shape=(128, 128))) for _ in range(2)]
    with torch.no_grad():
        before = det(x, ds, mode="tensor")
        names = install_latte_cores(det, LatteConfig(candidates=list(RTDETR_CANDIDATES)))
        assert names == ["hf.model.encoder.aifi.0.layers.0.self_attn"] + [
            f"hf.model.decoder.layers.{i}.self_attn" for i in range(6)]
        after = det(x, ds, mode="tensor")
        for a, b in zip(before, after):
            assert torch.equal(a, b)  # exact mode: bit-identical
        set_modes(find_latte_layers(det), names)
        lin = det(x, ds, mode="tensor")
    assert all(torch.isfinite(t).all() for t in lin)
    assert not torch.allclose(lin[0], before[0])


def test_rtdetr_trains_one_step_through_mmdet_loss(synthetic_data, tmp_path):
    from mmengine.runner import Runner

    cfg = _cfg(synthetic_data, str(tmp_path))
    cfg.custom_hooks = []
    cfg.train_cfg = dict(type="IterBasedTrainLoop", max_iters=2, val_interval=100)
    cfg.param_scheduler = []
    runner = Runner.from_cfg(cfg)
    runner.train()
    hist = runner.message_hub.get_scalar("train/loss")
    assert np.isfinite(hist.current())


def test_calibrate_tool_on_rtdetr_reports_exact_and_linearized_map(synthetic_data, tmp_path):
    from latte_plugin.mmdet.workflow import run_calibration

    cfg = _cfg(synthetic_data, str(tmp_path / "cal"), num_images=4, steps=5)
    cfg_path = tmp_path / "rtdetr_tiny.py"
    cfg.dump(str(cfg_path))
    report = run_calibration(str(cfg_path), work_dir=str(tmp_path / "cal"), evaluate=True)
    saved = json.load(open(report["paths"]["report"]))
    assert len(saved["candidates"]) == 7 and len(saved["linearized"]) == 5  # 67% of 7, the paper's protocol
    assert set(saved["metrics"]) == {"exact", "linearized"}
    ckpt = torch.load(report["paths"]["checkpoint"], weights_only=True)
    assert any(k.endswith("self_attn.latte.m") for k in ckpt["state_dict"])


def test_embedded_rtdetr_checkpoint_matches_its_config():
    from mmengine.config import Config
    from mmdet.registry import MODELS

    path = os.path.join(ROOT, "checkpoints", "rtdetr_r18_synthetic.pth")
    if not os.path.exists(path):
        pytest.skip("the embedded RT-DETR checkpoint is not committed yet")
    assert os.path.getsize(path) <= 25 * 2**20
    cfg = Config.fromfile(EMBEDDED_RTDETR)
    det = MODELS.build(cfg.model)
    sd = torch.load(path, weights_only=True)["state_dict"]
    missing, unexpected = det.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not missing and not unexpected
