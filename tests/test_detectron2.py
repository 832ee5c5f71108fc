"""Detectron2: the same mmdet / HF models as meta-architectures, LATTE by LazyConfig override,
the HookBase calibrating from the endless train loader, tools/calibrate.py on a LazyConfig,
COCOEvaluator equal to mmdet's CocoMetric on one checkpoint, and 2-process ``launch``.

Skipped, with the reason, where detectron2 is not installed (it is not on PyPI: README)."""
import copy
import json
import os
import socket

import pytest
import torch

from tests.conftest import ROOT, TINY_CFG, require

require("detectron2")
require("detectron2._C")
require("mmdet.models")
import latte_plugin.detectron2 as d2p  # noqa: E402
from latte_plugin.nn.install import find_latte_layers, set_modes

D2_CFG = os.path.join(ROOT, "configs", "detectron2", "embedded", "cond_detr_r18_synthetic_latte.py")
TINY_RTDETR = os.path.join(ROOT, "configs", "mmdet", "rtdetr_tiny_latte_synthetic.py")
COND_CKPT = os.path.join(ROOT, "checkpoints", "cond_detr_r18_synthetic.pth")
COND_MMDET = os.path.join(ROOT, "configs", "mmdet", "embedded", "cond_detr_r18_synthetic.py")


@pytest.fixture(scope="module")
def synthetic_data(tmp_path_factory):
    """256-pixel images: the network size, so neither framework resizes (their resize kernels differ)."""
    from latte_plugin.data.synthetic import make_synthetic_coco

    return make_synthetic_coco(str(tmp_path_factory.mktemp("synthetic256")), num_train=8, num_val=6, size=256, seed=0)


def _lazy(data_root, *opts, prefix="latte_test"):
    """The embedded LATTE LazyConfig pointed at ``data_root`` (registered under ``prefix``: a
    registration is kept for the process, so another split needs another prefix)."""
    from detectron2.config import LazyConfig

    train, val = d2p.register_synthetic(data_root, prefix=prefix)
    cfg = LazyConfig.load(D2_CFG)
    cfg = LazyConfig.apply_overrides(cfg, [
        f"dataloader.train.dataset.names={train}", f"dataloader.test.dataset.names={val}",
        f"dataloader.evaluator.dataset_name={val}", f"model.calibration_loader.dataset.names={train}",
        "dataloader.train.total_batch_size=2", "dataloader.train.num_workers=0", *opts])
    return cfg


def _d2_inputs(img_bgr):
    t = torch.as_tensor(img_bgr.transpose(2, 0, 1).copy())
    return [{"image": t, "height": img_bgr.shape[0], "width": img_bgr.shape[1], "image_id": 0}]


@pytest.mark.parametrize("mmdet_config", [TINY_CFG, TINY_RTDETR], ids=["detr", "rtdetr"])
def test_meta_arch_is_the_mmdet_model_with_detectron2_io(mmdet_config):
    import numpy as np
    from detectron2.config import LazyCall as L, instantiate
    from detectron2.modeling import META_ARCH_REGISTRY
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmengine.config import Config

    assert META_ARCH_REGISTRY.get("MMDetDetector") is d2p.MMDetDetector
    torch.manual_seed(0)
    model = instantiate(L(d2p.MMDetDetector)(mmdet_config=mmdet_config)).eval()
    ref = MODELS.build(copy.deepcopy(Config.fromfile(mmdet_config).model)).eval()
    assert list(model.state_dict()) == list(ref.state_dict())  # mmdet's keys: one checkpoint for both
    ref.load_state_dict(model.state_dict())
    img = np.random.default_rng(0).integers(0, 255, size=(96, 128, 3), dtype=np.uint8)
    with torch.no_grad():
        out = model(_d2_inputs(img))[0]["instances"]
        data = ref.data_preprocessor({"inputs": [torch.as_tensor(img.transpose(2, 0, 1).copy())],
                                      "data_samples": [DetDataSample(metainfo=dict(
                                          img_shape=(96, 128), ori_shape=(96, 128), scale_factor=(1.0, 1.0)))]},
                                     False)
        exp = ref(**data, mode="predict")[0].pred_instances
    assert out.image_size == (96, 128)
    torch.testing.assert_close(out.pred_boxes.tensor, exp.bboxes)
    torch.testing.assert_close(out.scores, exp.scores)
    assert torch.equal(out.pred_classes, exp.labels)


def test_lazyconfig_overrides_turn_latte_on(synthetic_data):
    from detectron2.config import instantiate

    cfg = _lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.ratio=0.5",
                "model.latte.variant=jpn_only", "model.latte.num_images=4", "model.latte.steps=3")
    model = instantiate(cfg.model)
    layers = find_latte_layers(model)
    assert list(layers) == [f"encoder.layers.{i}.self_attn" for i in range(6)]
    assert all(l.variant == "jpn_only" for l in layers.values())
    # first evaluation forward on a plain checkpoint: the model calibrates itself (calibrate='auto')
    batch = next(iter(instantiate(cfg.dataloader.test)))
    model.eval()
    with torch.no_grad():
        model(batch)
    assert all(bool(l.calibrated) for l in layers.values())
    assert sum(l.mode == "linear" for l in layers.values()) == 3


def test_hook_calibrates_from_the_endless_train_loader(synthetic_data):
    from detectron2.config import instantiate
    from detectron2.engine import SimpleTrainer

    cfg = _lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.calibrate=never")
    model = instantiate(cfg.model)
    loader = instantiate(cfg.dataloader.train)  # TrainingSampler: never ends
    trainer = SimpleTrainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.0))
    hook = d2p.LinearizeHook(dict(candidates=["encoder.layers.*.self_attn"], num_images=6, steps=3))
    trainer.register_hooks([hook])
    hook.before_train()
    layers = find_latte_layers(model)
    assert all(bool(l.calibrated) for l in layers.values())
    assert len(hook.report["linearized"]) == 4
    # the same calibrate= vocabulary as everywhere: auto keeps calibrated state, never requires it
    again = d2p.LinearizeHook(dict(candidates=["encoder.layers.*.self_attn"], num_images=6, steps=3))
    trainer.register_hooks([again])
    again.before_train()
    assert again.report is None
    fresh = instantiate(cfg.model)
    never = d2p.LinearizeHook(dict(candidates=["encoder.layers.*.self_attn"], calibrate="never"))
    never.trainer = SimpleTrainer(fresh, loader, torch.optim.SGD(fresh.parameters(), lr=0.0))
    with pytest.raises(ValueError, match="calibrate='never'"):
        never.before_train()
    with pytest.raises(ValueError, match="calibrate must be"):
        d2p.LinearizeHook({"calibrate": "sometimes"})


def test_calibrate_tool_on_a_lazyconfig_and_map_parity_with_mmdet(synthetic_data, tmp_path):
    """tools/calibrate.py picks detectron2 from the file; the same embedded checkpoint gives the
    same AP in COCOEvaluator as in mmdet's CocoMetric (within 0.5 AP), exact and linearized."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    from latte_plugin.cli import calibrate as calibrate_tool
    from latte_plugin.mmdet.workflow import unformatted

    root = synthetic_data.rstrip("/") + "/"
    train, val = d2p.register_synthetic(synthetic_data, prefix="latte_test")
    opts = [f"dataloader.test.dataset.names={val}", f"dataloader.evaluator.dataset_name={val}",
            f"dataloader.evaluator.output_dir={tmp_path / 'eval'}",
            f"model.calibration_loader.dataset.names={train}", f"dataloader.train.dataset.names={train}"]
    report = calibrate_tool.main([D2_CFG, "--checkpoint", COND_CKPT, "--work-dir", str(tmp_path / "d2"),
                                  "--num-images", "6", "--eval", "--selection", "score", "--correction", "sigma",
                                  "--compensate", "never", "--no-signal", "--cfg-options", *opts])
    saved = json.load(open(report["paths"]["report"]))
    assert saved["framework"] == "detectron2" and len(saved["linearized"]) == 4
    for key in ("variant", "candidates", "sensitivity", "params", "metrics", "retained", "attention_gflops"):
        assert key in saved

    # mmdet on the same images with the d2-calibrated checkpoint: the checkpoint is shared
    cfg = unformatted(Config.fromfile(os.path.join(ROOT, "configs", "mmdet", "embedded",
                                                   "cond_detr_r18_synthetic_latte.py")))
    for key in ("train_dataloader", "val_dataloader", "test_dataloader"):
        cfg[key]["dataset"]["data_root"] = root
        cfg[key]["num_workers"] = 0
        cfg[key]["persistent_workers"] = False
    for key in ("val_evaluator", "test_evaluator"):
        cfg[key]["ann_file"] = root + "annotations/instances_val.json"
    cfg.custom_hooks[0]["calibrate"] = "never"
    cfg.work_dir = str(tmp_path / "mm")
    cfg.default_hooks.checkpoint = None
    cfg.load_from = report["paths"]["checkpoint"]
    runner = Runner.from_cfg(cfg)
    lin = runner.test()["coco/bbox_mAP"]
    set_modes(find_latte_layers(runner.model), [])
    exact = runner.test()["coco/bbox_mAP"]
    assert abs(saved["metrics"]["exact"]["bbox_mAP"] - exact) <= 0.005
    assert abs(saved["metrics"]["linearized"]["bbox_mAP"] - lin) <= 0.005


@pytest.fixture(scope="module")
def train_split_of_12(tmp_path_factory):
    """A train split larger than num_images (12 > 7): which 7 are taken must not depend on the ranks."""
    from latte_plugin.data.synthetic import make_synthetic_coco

    return make_synthetic_coco(str(tmp_path_factory.mktemp("synthetic12")), num_train=12, num_val=2, size=128, seed=5)


def _launch_worker(out, data_root):
    from detectron2.config import instantiate
    from detectron2.utils import comm

    from latte_plugin.calibration.config import LatteConfig

    torch.set_num_threads(1)
    cfg = _lazy(data_root, f"model.mmdet_config={TINY_CFG}", "model.latte.calibrate=never", prefix="latte_test12")
    torch.manual_seed(0)
    model = instantiate(cfg.model).eval()
    loader = instantiate(cfg.model.calibration_loader)  # the COCO configs' loader: InferenceSampler, blocks per rank
    rep = d2p.calibrate_detector(model, loader, LatteConfig(candidates=["encoder.layers.*.self_attn"],
                                                            num_images=7, steps=5, max_queries=10000,
                                                            max_items=12, correction="refit",
                                                            selection="score"))
    if comm.is_main_process():
        state = {k: v.clone() for k, v in model.state_dict().items() if ".latte." in k}
        torch.save({"linearized": rep["linearized"], "images": rep["selection"]["images"], "state": state}, out)


@pytest.mark.timeout(600)
def test_detectron2_launch_two_processes_matches_one(train_split_of_12, tmp_path):
    """detectron2's own ``launch``, 2 gloo processes, the LazyConfig's calibration loader
    (``InferenceSampler``: rank 0 holds images 0-5, rank 1 images 6-11), 7 of 12 train images:
    the same images as 1 process (the first 7, from both ranks), the same selection, and every LATTE buffer
    (m, log_rho, sigma, refit weight and bias, modes) within 1e-5. Selection by score: the launch is
    under test here; the choice rule across processes is tests/test_distributed.py's."""
    from detectron2.engine import launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two, one = str(tmp_path / "two.pt"), str(tmp_path / "one.pt")
    launch(_launch_worker, 2, dist_url=f"tcp://127.0.0.1:{port}", args=(two, train_split_of_12))
    _launch_worker(one, train_split_of_12)
    a, b = torch.load(two, weights_only=True), torch.load(one, weights_only=True)
    assert sum(b["images"].values()) == 7 and a["images"] == b["images"]
    assert a["linearized"] == b["linearized"]
    assert any(k.endswith("refit_weight") and not torch.equal(v, torch.eye(v.shape[0])) for k, v in b["state"].items())
    assert a["state"].keys() == b["state"].keys()
    for k, v in b["state"].items():
        torch.testing.assert_close(a["state"][k], v, atol=1e-5, rtol=0, msg=k)


@pytest.mark.parametrize("name,count", [("cond_detr_r18_synthetic_latte.py", 6), ("rtdetr_r18_synthetic_latte.py", 7),
                                        ("deimv2_vit6_synthetic_latte.py", 10)])
def test_embedded_lazyconfigs_build_with_latte(synthetic_data, name, count):
    """The embedded detectron2 LazyConfigs instantiate with their LATTE candidates swapped in."""
    from detectron2.config import LazyConfig, instantiate

    train, _ = d2p.register_synthetic(synthetic_data, prefix="latte_test")
    cfg = LazyConfig.load(os.path.join(ROOT, "configs", "detectron2", "embedded", name))
    cfg = LazyConfig.apply_overrides(cfg, [f"model.calibration_loader.dataset.names={train}"])
    model = instantiate(cfg.model)
    assert len(find_latte_layers(model)) == count and model.latte_cfg.ratio == 0.67


def test_meta_arch_and_hook_apply_mode_and_threshold_to_a_loaded_calibration(synthetic_data, tmp_path):
    """A calibrated checkpoint under ``model.latte.mode=dynamic`` (and the hook's ``mode``): the
    linear layers become dynamic with the given threshold, with no recalibration."""
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import instantiate
    from detectron2.engine import SimpleTrainer

    from latte_plugin.storage import save_calibrated_checkpoint

    cfg = _lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.num_images=2", "model.latte.steps=1",
                "model.latte.greedy_images=1")
    model = instantiate(cfg.model).eval()
    batch = next(iter(instantiate(cfg.dataloader.test)))
    with torch.no_grad():
        model(batch)  # calibrates itself
    linear = sorted(n for n, l in find_latte_layers(model).items() if l.mode == "linear")
    assert linear
    path = str(tmp_path / "cal.pth")
    save_calibrated_checkpoint(model, {"variant": "latte", "candidates": [], "linearized": linear, "config": {}}, path)

    cfg = _lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.mode=dynamic",
                "model.latte.threshold=9")
    fresh = instantiate(cfg.model).eval()
    DetectionCheckpointer(fresh).load(path)
    with torch.no_grad():
        fresh(batch)
    layers = find_latte_layers(fresh)
    assert sorted(n for n, l in layers.items() if l.mode == "dynamic") == linear
    assert all(int(l.threshold) == 9 for l in layers.values())

    other = instantiate(_lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.calibrate=never").model)
    DetectionCheckpointer(other).load(path)
    hook = d2p.LinearizeHook(dict(candidates=["encoder.layers.*.self_attn"], mode="dynamic", threshold=5))
    hook.trainer = SimpleTrainer(other, [batch], torch.optim.SGD(other.parameters(), lr=0.0))
    hook.before_train()
    assert hook.report is None
    layers = find_latte_layers(other)
    assert sorted(n for n, l in layers.items() if l.mode == "dynamic") == linear
    assert all(int(l.threshold) == 5 for l in layers.values())


def test_both_hooks_take_the_same_options_and_write_the_report(synthetic_data, tmp_path):
    """detectron2's hook takes LatteConfig fields as keywords, as mmdet's does, and after a
    calibration writes latte_report.json to its work_dir."""
    import inspect

    from detectron2.config import instantiate
    from detectron2.engine import SimpleTrainer

    from latte_plugin.mmdet import LinearizeHook as MMDetHook

    assert "candidates" in inspect.signature(MMDetHook).parameters
    cfg = _lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.calibrate=never")
    model = instantiate(cfg.model)
    trainer = SimpleTrainer(model, instantiate(cfg.dataloader.train), torch.optim.SGD(model.parameters(), lr=0.0))
    hook = d2p.LinearizeHook(candidates=["encoder.layers.*.self_attn"], num_images=2, steps=1, greedy_images=1,
                             work_dir=str(tmp_path))
    trainer.register_hooks([hook])
    hook.before_train()
    saved = json.load(open(tmp_path / "latte_report.json"))
    assert saved["linearized"] == hook.report["linearized"] and len(saved["linearized"]) == 4


def test_registering_another_split_under_a_used_name_points_it_at_the_new_split(synthetic_data, train_split_of_12):
    from detectron2.data import DatasetCatalog

    train, _ = d2p.register_synthetic(synthetic_data, prefix="latte_rereg")
    assert len(DatasetCatalog.get(train)) == 8
    train, _ = d2p.register_synthetic(train_split_of_12, prefix="latte_rereg")
    assert len(DatasetCatalog.get(train)) == 12


def test_a_checkpoint_calibrated_for_other_candidates_is_refused(synthetic_data, tmp_path):
    """As mmdet's hook does: LATTE state for layers the config does not name stops the load."""
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import instantiate

    from latte_plugin.storage import CheckpointError

    cfg = _lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.num_images=2", "model.latte.steps=1",
                "model.latte.greedy_images=1")
    model = instantiate(cfg.model).eval()
    with torch.no_grad():
        model(next(iter(instantiate(cfg.dataloader.test))))  # calibrates all 6 encoder layers
    path = str(tmp_path / "cal.pth")
    torch.save({"model": model.state_dict()}, path)
    fewer = instantiate(_lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}",
                              "model.latte.candidates=['encoder.layers.0.self_attn','encoder.layers.1.self_attn']").model)
    with pytest.raises(CheckpointError, match="calibrated for other LATTE candidates"):
        DetectionCheckpointer(fewer).load(path)
    same = instantiate(cfg.model)
    DetectionCheckpointer(same).load(path)  # the same candidates load
    assert all(bool(l.calibrated) for l in find_latte_layers(same).values())


def test_input_size_sets_the_lazyconfig_resizes_and_the_tools_loaders(synthetic_data, tmp_path, monkeypatch):
    """input_size (height, width) on LazyCall'd augmentations: ``Resize`` takes the shape,
    ``ResizeShortestEdge`` the smaller side within the larger. The tool resizes the calibration and
    the test loaders (96 px here, the config's 256); the meta-arch, whose loader detectron2 has
    built, refuses to calibrate with it in one line; a list without a resize is named."""
    from detectron2.config import LazyCall as L
    from detectron2.config import LazyConfig
    from detectron2.data import transforms as T

    from latte_plugin.detectron2 import workflow
    from latte_plugin.detectron2.data import resize_augmentations

    augs = [L(T.Resize)(shape=(640, 640)), L(T.ResizeShortestEdge)(short_edge_length=800, max_size=1333),
            L(T.RandomFlip)()]
    resize_augmentations(augs, (512, 768), "test")
    assert augs[0].shape == (512, 768) and (augs[1].short_edge_length, augs[1].max_size) == (512, 768)
    with pytest.raises(ValueError, match="input_size: x has no Resize or ResizeShortestEdge"):
        resize_augmentations([L(T.RandomFlip)()], (512, 512), "x")

    cfg_path = tmp_path / "d2.yaml"
    LazyConfig.save(_lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "train.init_checkpoint=''"), str(cfg_path))
    seen = {}

    def stop(model, loader, latte_cfg):
        seen["image"] = next(iter(loader))[0]["image"].shape[-2:]
        raise KeyboardInterrupt  # enough: the loaders are what is under test

    monkeypatch.setattr(workflow, "calibrate_detector", stop)
    load = workflow.load_config
    monkeypatch.setattr(workflow, "load_config", lambda *a: seen.setdefault("cfg", load(*a)))
    with pytest.raises(KeyboardInterrupt):
        workflow.run_calibration(str(cfg_path), overrides=dict(input_size=[96]))
    assert seen["image"] == (96, 96)
    assert [(a.short_edge_length, a.max_size) for a in seen["cfg"].dataloader.test.mapper.augmentations] == [(96, 96)]
    from detectron2.config import instantiate

    model = instantiate(_lazy(synthetic_data, f"model.mmdet_config={TINY_CFG}", "model.latte.input_size=[96]").model)
    with pytest.raises(ValueError, match="model.latte.input_size cannot resize a calibration_loader that is already built"):
        model.eval()(_d2_inputs(__import__("numpy").zeros((64, 64, 3), dtype="uint8")))
