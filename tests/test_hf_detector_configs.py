"""Each transformers detector family's COCO configs, as a user runs them: the architecture of its
smallest public COCO model with random weights, written by ``save_pretrained`` and loaded with
every key; calibrated and evaluated on generated data in COCO 2017's layout through
``tools/calibrate.py`` (mmdet, CocoMetric) and detectron2's own ``lazyconfig_train_net.py
--eval-only`` (COCOEvaluator). Inputs are small (the family's smallest runnable size)."""
import importlib.util
import os

import pytest
import torch

from tests.conftest import ROOT, lively, require

require("transformers")
from latte_plugin.hf.detectors import FAMILIES, build_detector  # noqa: E402

#: generated image sizes: the smallest each family runs at (RF-DETR Nano needs 300 encoder tokens,
#: LW-DETR 4 x 4 windows); the others at 160 px, where every feature level still has a few tokens
BIG = 320
SIDES = {"rf_detr": BIG, "lw_detr": BIG}
SIDE = 160
# the paper's protocol (score + sigma) on 2 images: the adaptive defaults search 9 configurations, which is
# what tests/test_configurations.py covers; here the configs and frameworks are under test
FAST = ["--num-images", "2", "--steps", "1", "--selection", "score", "--correction", "sigma", "--compensate", "never",
        "--no-signal"]
ARCHS = {fam.name: fam.architecture for fam in FAMILIES.values()}
#: name -> (mmdet config, detectron2 LazyConfig); test_every_config_is_exercised_by_a_test reads these names:
#: hf_rt_detr_r18vd_latte_coco.py hf_rt_detr_v2_r18vd_latte_coco.py hf_d_fine_s_latte_coco.py
#: hf_deimv2_dinov3_s_latte_coco.py hf_lw_detr_tiny_latte_coco.py hf_rf_detr_nano_latte_coco.py
#: hf_yolos_tiny_latte_coco.py hf_conditional_detr_r50_latte_coco.py hf_deformable_detr_r50_latte_coco.py
#: hf_detector_latte_coco.py hf_detector_latte_coco_800.py
CONFIG = "hf_{}_latte_coco.py"


@pytest.fixture(scope="module")
def coco_roots(tmp_path_factory):
    """Generated data in COCO 2017's layout, one directory per image size."""
    from latte_plugin.data.synthetic import make_coco_layout

    return {side: make_coco_layout(str(tmp_path_factory.mktemp(f"coco{side}")), num_train=2, num_val=2, size=side,
                                   seed=3) for side in (SIDE, BIG)}


def _side(family: str) -> int:
    return SIDES.get(family, SIDE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family)``: a random-weight model of the family's architecture, written as
    transformers writes it, once per family for the module (the tests only read the directory)."""
    made: dict = {}

    def get(family: str) -> tuple[str, dict]:
        if family not in made:
            path = tmp_path_factory.mktemp(f"hf_{family}")
            torch.manual_seed(0)
            hf = lively(build_detector(family, ARCHS[family])).eval()
            hf.save_pretrained(str(path))
            made[family] = str(path), {"hf." + k: v for k, v in hf.state_dict().items()}
        return made[family]

    return get


def _mmdet_cfg(arch: str, root: str, work_dir: str, path: str, side: int) -> None:
    from mmengine.config import Config

    from latte_plugin.mmdet.workflow import unformatted

    cfg = unformatted(Config.fromfile(os.path.join(ROOT, "configs", "mmdet", CONFIG.format(arch))))
    root = root.rstrip("/") + "/"
    for key in ("train_dataloader", "val_dataloader", "test_dataloader"):
        cfg[key].dataset.data_root = root
        for t in cfg[key].dataset.pipeline:
            if t.get("type") == "Resize":
                t.update(scale=(side, side), keep_ratio=False)
    for key in ("val_evaluator", "test_evaluator"):
        cfg[key].ann_file = root + "annotations/instances_val2017.json"
    cfg.work_dir = work_dir
    cfg.default_hooks.checkpoint = None
    cfg.dump(path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mmdet_config_calibrates_and_evaluates_a_save_pretrained_directory(family, coco_roots, saved, tmp_path):
    """``tools/calibrate.py CONFIG --cfg-options model.pretrained=DIR --eval``: every key of the
    saved model lands, the candidates are found from the model, 67% go linear, CocoMetric reports."""
    require("mmdet.models")
    require("mmcv.ops")
    from latte_plugin.cli import calibrate as calibrate_tool

    hf_dir, want = saved(family)
    side = _side(family)
    _mmdet_cfg(ARCHS[family], coco_roots[side], str(tmp_path / "w"), str(tmp_path / "cfg.py"), side)
    report = calibrate_tool.main([str(tmp_path / "cfg.py"), "--cfg-options", f"model.pretrained={hf_dir}",
                                  "--work-dir", str(tmp_path / "w"), "--eval", *FAST])
    n = len(report["candidates"])
    assert n >= 1 and len(report["linearized"]) == max(1, round(0.67 * n)), report["linearized"]
    assert set(report["metrics"]) == {"exact", "linearized"}
    got = torch.load(report["paths"]["checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    got = {k: v for k, v in got.items() if ".latte." not in k}
    assert set(got) == set(want), (sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3])
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k


def _lazyconfig_train_net():
    """detectron2's own tools/lazyconfig_train_net.py, imported as a module (from LATTE_DETECTRON2_SRC)."""
    from tests.test_coco_configs import _d2_script

    script = _d2_script()
    if script is None:
        pytest.skip("detectron2's tools/lazyconfig_train_net.py is not installed: set LATTE_DETECTRON2_SRC")
    spec = importlib.util.spec_from_file_location("lazyconfig_train_net", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _register(root: str, side: int) -> str:
    from detectron2.data import DatasetCatalog
    from detectron2.data.datasets import register_coco_instances

    for split in ("train", "val"):
        name = f"latte_hf_coco{side}_{split}"
        if name not in DatasetCatalog.list():
            register_coco_instances(name, {}, os.path.join(root, "annotations", f"instances_{split}2017.json"),
                                    os.path.join(root, f"{split}2017"))
    return f"latte_hf_coco{side}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_detectron2_lazyconfig_evaluates_a_save_pretrained_directory(family, coco_roots, saved, tmp_path, capsys,
                                                                    monkeypatch):
    """``lazyconfig_train_net.py --eval-only --config-file CONFIG model.pretrained=DIR``, in this
    process: the model calibrates itself on 2 train images at the first evaluation forward
    (candidates found from the model), COCOEvaluator reports AP; every key of the saved model lands."""
    require("detectron2")
    script = _lazyconfig_train_net()
    hf_dir, want = saved(family)
    name = _register(coco_roots[_side(family)], _side(family))
    overrides = [f"model.pretrained={hf_dir}", "dataloader.test.mapper.augmentations=[]",
                 "model.calibration_loader.mapper.augmentations=[]", f"dataloader.test.dataset.names={name}_val",
                 f"model.calibration_loader.dataset.names={name}_train", "model.latte.num_images=2",
                 "model.latte.steps=1", "model.latte.selection=score",
                 "model.latte.correction=sigma", "model.latte.compensate=never", "model.latte.signal=False",
                 "model.calibration_loader.num_workers=0",
                 "dataloader.test.num_workers=0", f"train.output_dir={tmp_path / 'out'}", "train.device=cpu"]
    args = script.default_argument_parser().parse_args(
        ["--eval-only", "--config-file", os.path.join(ROOT, "configs", "detectron2", CONFIG.format(ARCHS[family])),
         *overrides])
    evaluated = []  # the model the script built and evaluated
    monkeypatch.setattr(script, "do_test", lambda cfg, model, _f=script.do_test: evaluated.append(model) or _f(cfg, model))
    script.main(args)
    printed = capsys.readouterr().out
    assert "'bbox'" in printed and "'AP'" in printed, printed[-2000:]
    got = {k: v for k, v in evaluated[0].state_dict().items() if ".latte." not in k}
    assert set(got) == set(want), (sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3])
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["deimv2", "d_fine"])
def test_onnx_export_of_the_calibrated_family_gives_torchs_outputs_and_map(family, coco_roots, saved, tmp_path):
    """``tools/calibrate.py`` then ``tools/export_onnx.py --eval`` on the family's config: onnxruntime's
    raw outputs equal torch's within 1e-4 with the queries matched (the two-stage top-k may swap
    nearly tied queries), and both give the same CocoMetric mAP."""
    require("mmdet.models")
    from latte_plugin.cli import calibrate as calibrate_tool
    from latte_plugin.cli import export_onnx as export_tool

    hf_dir, _ = saved(family)
    side = _side(family)
    _mmdet_cfg(ARCHS[family], coco_roots[side], str(tmp_path / "w"), str(tmp_path / "cfg.py"), side)
    opts = ["--cfg-options", f"model.pretrained={hf_dir}"]
    report = calibrate_tool.main([str(tmp_path / "cfg.py"), *opts, "--work-dir", str(tmp_path / "w"), *FAST])
    out = export_tool.main([str(tmp_path / "cfg.py"), report["paths"]["checkpoint"], "--out", str(tmp_path / "m.onnx"),
                            "--eval", *opts])
    assert out["linear"] == report["linearized"] and len(out["linear"]) > 0
    m = out["metrics"]
    assert m["max_query_matched_diff_val"] < 1e-4, m
    assert round(m["torch"]["bbox_mAP"], 3) == round(m["onnxruntime"]["bbox_mAP"], 3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_config_uses_its_familys_size_and_normalisation(family):
    """The configs evaluate at the family's own input transform (640 x 640, RF-DETR Nano's 384, or
    DETR / YOLOS' shortest edge 800, longest 1333) and mmdet normalises as the family's processor
    (the detectron2 wrapper reads the normalisation from the family itself)."""
    from mmengine.config import Config

    fam, arch = FAMILIES[family], ARCHS[family]
    cfg = Config.fromfile(os.path.join(ROOT, "configs", "mmdet", CONFIG.format(arch)))
    resize = next(t for t in cfg.test_dataloader.dataset.pipeline if t["type"] == "Resize")
    h, w = fam.size
    assert tuple(resize["scale"]) == ((w, h) if h != w else (h, w)) and resize["keep_ratio"] == (h != w)
    pre = cfg.model.data_preprocessor
    assert pre["std"] == pytest.approx([255 * s for s in fam.std] if fam.std else [255, 255, 255])
    assert cfg.model.family == family and cfg.model.hf_config == arch
    if _importable_detectron2():
        from detectron2.config import LazyConfig

        d2 = LazyConfig.load(os.path.join(ROOT, "configs", "detectron2", CONFIG.format(arch)))
        aug = d2.dataloader.test.mapper.augmentations[0]
        want = dict(short_edge_length=h, max_size=w) if h != w else dict(shape=(h, w))
        assert {k: aug[k] for k in want} == want and d2.model.family == family
        assert d2.model.calibration_loader.mapper.augmentations == d2.dataloader.test.mapper.augmentations


def _importable_detectron2() -> bool:
    try:
        import detectron2.config  # noqa: F401
    except ImportError:
        return False
    return True
