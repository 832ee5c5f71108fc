"""The real users' path: the COCO configs at their real architectures (random weights, smaller
inputs), on generated data in COCO 2017's layout with its 80 real categories, fed the public
checkpoint formats through the user-facing commands; labels map to COCO ids in both evaluators."""
import copy
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, require

require("mmcv.ops")
require("mmdet.models")
require("transformers")
import latte_plugin.mmdet  # noqa: E402,F401

from latte_plugin.cli import calibrate as calibrate_tool
from latte_plugin.cli import convert_rtdetr_original as converter

MMDET_CONFIGS = os.path.join(ROOT, "configs", "mmdet")
SIDE = 160  # test-time input size (the configs' own: 1333x800 for DETR, 640x640 for RT-DETR): keys and wiring under test
FAST = ["--num-images", "2", "--steps", "1", "--greedy-images", "1"]
# the paper's protocol for the in-process tool runs: the configs, checkpoints and evaluators are under
# test here; the adaptive choice (its judged forwards) is tests/test_configurations.py's
PAPER = ["--selection", "score", "--correction", "sigma", "--compensate", "never", "--no-signal"]


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    from latte_plugin.data.synthetic import make_coco_layout

    return make_coco_layout(str(tmp_path_factory.mktemp("coco")), num_train=2, num_val=4, size=SIDE, seed=1)


def _resize_to(pipeline, side: int) -> None:
    for t in pipeline:
        if t.get("type") == "Resize":
            t["scale"] = (side, side)


def coco_cfg(name: str, root: str, work_dir: str, path: str):
    """A COCO config pointed at ``root`` (only ``data_root`` and the annotation file change),
    test inputs at SIDE px, no pretrained-backbone download, dumped to ``path``."""
    from mmengine.config import Config

    from latte_plugin.mmdet.workflow import unformatted

    cfg = unformatted(Config.fromfile(os.path.join(MMDET_CONFIGS, name)))
    root = root.rstrip("/") + "/"
    for key in ("train_dataloader", "val_dataloader", "test_dataloader"):
        cfg[key].dataset.data_root = root
    for key in ("val_evaluator", "test_evaluator"):
        cfg[key].ann_file = root + "annotations/instances_val2017.json"
    for key in ("val_dataloader", "test_dataloader"):
        _resize_to(cfg[key].dataset.pipeline, SIDE)
    if "backbone" in cfg.model:
        cfg.model.backbone.init_cfg = None
    cfg.work_dir = work_dir
    cfg.default_hooks.checkpoint = None
    cfg.dump(path)
    return cfg


def _model_state(path: str) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if ".latte." not in k}


def _build(cfg):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    register_all_modules()
    return MODELS.build(copy.deepcopy(cfg.model))


def _assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5])
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k


@pytest.mark.timeout(900)
def test_detr_r50_coco_config_takes_an_mmdet_model_zoo_checkpoint(coco_root, tmp_path):
    """mmdet's model-zoo DETR-R50 format (``meta`` + ``state_dict``, mmdet's key names) through
    ``tools/calibrate.py --checkpoint``: every key lands, calibration and CocoMetric run."""
    from mmdet.datasets import CocoDataset

    cfg = coco_cfg("detr_r50_latte_coco.py", coco_root, str(tmp_path / "w"), str(tmp_path / "detr.py"))
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in _build(cfg).state_dict().items()}
    zoo = str(tmp_path / "detr_r50_8xb2-150e_coco_20221023_153551-436d03e8.pth")
    torch.save({"meta": {"mmdet_version": "3.0.0rc6", "dataset_meta": dict(CocoDataset.METAINFO), "epoch": 150},
                "state_dict": state}, zoo)
    report = calibrate_tool.main([str(tmp_path / "detr.py"), "--checkpoint", zoo, "--work-dir", str(tmp_path / "w"),
                                  "--eval", *FAST, *PAPER])
    assert len(report["linearized"]) == 4 and set(report["metrics"]) == {"exact", "linearized"}
    _assert_same_weights(_model_state(report["paths"]["checkpoint"]), state)


def _hf_rtdetr(arch: str, seed: int = 0):
    from transformers import RTDetrForObjectDetection

    torch.manual_seed(seed)
    return RTDetrForObjectDetection(converter.build_config(arch)).eval()


@pytest.fixture(scope="module")
def rtdetr_r50vd_dir(tmp_path_factory):
    """An HF RT-DETR-R50vd (random weights) written by ``save_pretrained`` once for the module,
    with the state it was saved from."""
    hf = _hf_rtdetr("r50vd")
    hf_dir = str(tmp_path_factory.mktemp("rtdetr_r50vd"))
    hf.save_pretrained(hf_dir)
    return hf_dir, hf.state_dict()


@pytest.mark.timeout(900)
def test_rtdetr_r50vd_coco_config_takes_an_hf_directory(coco_root, rtdetr_r50vd_dir, tmp_path):
    """An HF ``RTDetrForObjectDetection`` directory as published for RT-DETR-R50vd (config.json with
    COCO's 80 labels, model.safetensors) through ``tools/calibrate.py --cfg-options model.pretrained=DIR``:
    the config starts (it failed before: no train_cfg / optim_wrapper), every key lands."""
    hf_dir, saved = rtdetr_r50vd_dir
    assert json.load(open(os.path.join(hf_dir, "config.json")))["id2label"]["79"] == "toothbrush"
    coco_cfg("rtdetr_r50vd_latte_coco.py", coco_root, str(tmp_path / "w"), str(tmp_path / "rtdetr.py"))
    report = calibrate_tool.main([str(tmp_path / "rtdetr.py"), "--cfg-options", f"model.pretrained={hf_dir}",
                                  "--work-dir", str(tmp_path / "w"), "--eval", *FAST, *PAPER])
    assert len(report["candidates"]) == 7 and len(report["linearized"]) == 5
    # (transformers 5 writes some keys under their legacy names in the file and maps them back on
    # load, so the reference is the model that was saved, not the file's key list)
    want = {"hf." + k: v for k, v in saved.items()}
    _assert_same_weights(_model_state(report["paths"]["checkpoint"]), want)


def test_original_rtdetr_checkpoint_converts_with_every_key(tmp_path):
    """The original repository's format (``ema.module``, its key names as transformers' conversion
    script maps them): ``tools/convert_rtdetr_original.py`` writes an HF directory the configs take,
    with every key filled and every original key used."""
    from latte_plugin.mmdet.rtdetr import HFRTDETR

    hf = _hf_rtdetr("r18vd", seed=1)
    orig = converter.to_original(hf.state_dict())
    assert "backbone.res_layers.1.blocks.0.short.conv.conv.weight" in orig
    assert "decoder.decoder.layers.0.self_attn.in_proj_weight" in orig and "encoder.encoder.0.layers.0.linear1.weight" in orig
    src = str(tmp_path / "rtdetr_r18vd_dec3_6x_coco_from_paddle.pth")
    torch.save({"ema": {"module": orig, "updates": 1000}, "last_epoch": 71}, src)
    out = str(tmp_path / "hf")
    converter.main([src, out, "--arch", "r18vd"])
    det = HFRTDETR(pretrained=out)
    want = {k: v for k, v in hf.state_dict().items() if not k.endswith("num_batches_tracked")}
    got = {k[len("hf."):]: v for k, v in det.state_dict().items() if not k.endswith("num_batches_tracked")}
    _assert_same_weights(got, want)
    # a checkpoint of another architecture is refused, naming the keys
    with pytest.raises(SystemExit, match="does not match the RT-DETR architecture"):
        converter.main([src, str(tmp_path / "bad"), "--arch", "r50vd"])


def _gt(coco_root):
    ann = json.load(open(os.path.join(coco_root, "annotations", "instances_val2017.json")))
    ids = sorted(c["id"] for c in ann["categories"])
    assert len(ids) == 80 and ids[-1] == 90 and 12 not in ids  # COCO's real ids, gaps included
    return ann, {cid: i for i, cid in enumerate(ids)}  # contiguous label <- category id (both frameworks)


def test_coco_labels_map_to_category_ids_in_cocometric(coco_root):
    """Perfect predictions with contiguous labels 0..79 score 1.0 in CocoMetric; labels that
    ignore COCO's id gaps do not."""
    from mmdet.datasets import CocoDataset
    from mmdet.evaluation import CocoMetric

    ann, label_of = _gt(coco_root)
    assert {a["category_id"] for a in ann["annotations"]} - {1}  # ids past a gap are used

    def score(shift: int) -> float:
        metric = CocoMetric(ann_file=os.path.join(coco_root, "annotations", "instances_val2017.json"))
        metric.dataset_meta = dict(CocoDataset.METAINFO)
        for img in ann["images"]:
            objs = [a for a in ann["annotations"] if a["image_id"] == img["id"]]
            boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in objs)], dtype=torch.float32)
            labels = torch.tensor([label_of[a["category_id"]] + shift for a in objs]).clamp(max=79)
            metric.process({}, [{"img_id": img["id"], "ori_shape": (img["height"], img["width"]),
                                 "pred_instances": {"bboxes": boxes, "scores": torch.ones(len(objs)),
                                                    "labels": labels}}])
        return metric.evaluate(len(ann["images"]))["coco/bbox_mAP"]

    assert score(0) == pytest.approx(1.0)
    assert score(1) < 0.5


def test_coco_labels_map_to_category_ids_in_cocoevaluator(coco_root, tmp_path):
    """The same through detectron2's COCOEvaluator on the dataset registered from the same json."""
    require("detectron2")
    from detectron2.data import MetadataCatalog
    from detectron2.data.datasets import register_coco_instances
    from detectron2.evaluation import COCOEvaluator
    from detectron2.structures import Boxes, Instances

    ann, label_of = _gt(coco_root)
    name = f"latte_coco_layout_val_{os.getpid()}"
    register_coco_instances(name, {}, os.path.join(coco_root, "annotations", "instances_val2017.json"),
                            os.path.join(coco_root, "val2017"))
    from detectron2.data import DatasetCatalog

    DatasetCatalog.get(name)  # loads the json: sets the id -> contiguous mapping in the metadata
    assert MetadataCatalog.get(name).thing_dataset_id_to_contiguous_id == label_of

    def score(shift: int) -> float:
        ev = COCOEvaluator(name, output_dir=str(tmp_path / f"eval{shift}"))
        ev.reset()
        for img in ann["images"]:
            objs = [a for a in ann["annotations"] if a["image_id"] == img["id"]]
            inst = Instances((img["height"], img["width"]))
            inst.pred_boxes = Boxes(torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in objs)],
                                                 dtype=torch.float32))
            inst.scores = torch.ones(len(objs))
            inst.pred_classes = torch.tensor([label_of[a["category_id"]] + shift for a in objs]).clamp(max=79)
            ev.process([{"image_id": img["id"]}], [{"instances": inst}])
        return ev.evaluate()["bbox"]["AP"]

    assert score(0) == pytest.approx(100.0)
    assert score(1) < 50.0


def _d2_script():
    """detectron2's tools/lazyconfig_train_net.py from LATTE_DETECTRON2_SRC (the script is not installed)."""
    src = os.environ.get("LATTE_DETECTRON2_SRC", "")
    if os.path.isdir(src):
        return os.path.join(src, "tools", "lazyconfig_train_net.py")
    if os.path.isfile(src):
        import tempfile

        from experiments import parity_detectron2

        return parity_detectron2.d2_script(src, tempfile.mkdtemp())
    return None


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", ["detr_r50_latte_coco.py", "rtdetr_r50vd_latte_coco.py"])
def test_detectron2_coco_lazyconfigs_run_eval_only(coco_root, rtdetr_r50vd_dir, tmp_path, name):
    """The detectron2 COCO LazyConfigs, unchanged, on the COCO-layout data through detectron2's
    builtin ``coco_2017_*`` datasets (``DETECTRON2_DATASETS``), evaluated by COCOEvaluator in
    detectron2's own ``lazyconfig_train_net.py --eval-only`` (where LATTE_DETECTRON2_SRC gives the
    script): RT-DETR calibrated on 2 train images at the first evaluation forward; DETR-R50 from a
    checkpoint tools/calibrate.py calibrated with ``--speedup`` (per-layer modes from a cost model
    file), reproducing its AP."""
    require("detectron2")
    script = _d2_script()
    if script is None:
        pytest.skip("detectron2's tools/lazyconfig_train_net.py is not installed: set LATTE_DETECTRON2_SRC")
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    os.symlink(coco_root, datasets / "coco")
    overrides = ["dataloader.test.mapper.augmentations=[]", "model.calibration_loader.mapper.augmentations=[]",
                 "model.latte.num_images=2", "model.latte.steps=1",
                 "model.latte.greedy_images=1", "model.calibration_loader.num_workers=0",
                 "dataloader.test.num_workers=0", f"train.output_dir={tmp_path / 'out'}", "train.device=cpu"]
    env = dict(os.environ, DETECTRON2_DATASETS=str(datasets), PYTHONWARNINGS="ignore")
    config = os.path.join(ROOT, "configs", "detectron2", name)
    report = None
    if name.startswith("detr"):
        # calibrated first by tools/calibrate.py with the piecewise kernel (25 encoder tokens: 2 blocks
        # of 13), then loaded by the script: it must not recalibrate, and gives the tool's linearized AP
        # for --speedup, a cost model file where only the piecewise kernel saves time
        work, cost = tmp_path / "cal", tmp_path / "cost.json"
        cost.write_text(json.dumps({"exact_ms": 40.0, "layers_ms": {"*": {"exact": 5.0, "latte": 6.0, "piecewise@1": 2.0}}}))
        cal = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "calibrate.py"), config, "--checkpoint",
                              tiny_detr_checkpoint(tmp_path), "--work-dir", str(work), "--eval", *FAST, *PAPER, "--speedup",
                              "1.3", "--cost-model", str(cost), "--piecewise-block", "16", "--cfg-options", *overrides],
                             capture_output=True, text=True, env=env, cwd=str(tmp_path))
        assert cal.returncode == 0, (cal.stdout + cal.stderr)[-4000:]
        report = json.load(open(work / "latte_report.json"))
        assert report["speed"]["predicted_speedup"] >= 1.3 and len(report["linearized"]) >= 4
        assert {f["kernel"]["kernel"] for n, f in report["fit"].items() if n in report["linearized"]} == {"piecewise"}
        overrides.append(f"train.init_checkpoint={work / 'latte_calibrated.pth'}")
    else:  # the paper's protocol (see PAPER): the first-forward calibration is under test, not the choice
        overrides += [f"model.pretrained={rtdetr_r50vd_dir[0]}", "model.latte.selection=score",
                      "model.latte.correction=sigma", "model.latte.compensate=never", "model.latte.signal=False"]
    out = subprocess.run([sys.executable, script, "--eval-only", "--config-file", config, *overrides],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "copypaste: AP,AP50" in text, text[-3000:]
    assert ("calibrating the LATTE layers" in text) == (report is None), text[-3000:]
    if report is not None:
        lines = text.splitlines()
        values = lines[next(i for i, x in enumerate(lines) if "copypaste: AP,AP50" in x) + 1].split("copypaste: ")[1]
        ap = float(values.split(",")[0]) / 100
        assert ap == pytest.approx(report["metrics"]["linearized"]["bbox_mAP"], abs=1e-4)


def tiny_detr_checkpoint(tmp_path) -> str:
    """A random DETR-R50 checkpoint in mmdet's model-zoo format, made loadable by detectron2 with
    tools/slim_checkpoint.py (detectron2's checkpointer cannot read mmdet's layout)."""
    from mmengine.config import Config

    import mmdet

    cfg = Config.fromfile(os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", "detr",
                                       "detr_r50_8xb2-150e_coco.py"))
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
    zoo = str(tmp_path / "detr_r50_zoo.pth")
    torch.save({"meta": {"epoch": 150}, "state_dict": _build(cfg).state_dict()}, zoo)
    from latte_plugin.cli import slim_checkpoint

    slim_checkpoint.main([zoo, str(tmp_path / "detr_r50_d2.pth")])
    return str(tmp_path / "detr_r50_d2.pth")


def test_every_config_is_exercised_by_a_test():
    """Each file under configs/ is named by some test (this module or another)."""
    tests = "".join(open(p).read() for p in glob.glob(os.path.join(ROOT, "tests", "*.py")))
    for path in glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True):
        name = os.path.basename(path)
        if name.startswith("_") or "/_base_/" in path:
            continue
        assert name in tests or os.path.splitext(name)[0] in tests, f"no test uses {os.path.relpath(path, ROOT)}"
