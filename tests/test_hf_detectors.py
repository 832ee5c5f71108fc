"""transformers' detectors through the plugin's one wrapper (mmdet ``HFDetector``, detectron2
``LatteHFDetector``): every family at the architecture of its smallest public COCO model
(random weights, small inputs) gives transformers' own boxes and scores, its candidates are
found from the model, RoPE layers see rotated q/k, and a biased attention is refused."""
import os

import pytest
import torch

from tests.conftest import ROOT, require

require("transformers")
from latte_plugin.hf.detectors import FAMILIES, build_detector, naive_postprocess, postprocess  # noqa: E402

TOL = 1e-5


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_detector(family, FAMILIES[family].architecture).eval()


def _image(side: int, seed: int = 0) -> torch.Tensor:
    """An RGB ``(side, side, 3)`` image, given at the network's input size: resizing is each framework's own."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8)


def _transformers_pipeline(family: str, hf, image: torch.Tensor, original: tuple, top_k: int):
    """transformers' own pipeline: the family's image processor (no resize), the model and
    ``post_process_object_detection`` (threshold off, the processor's top-k)."""
    import transformers

    fam = FAMILIES[family]
    kw = dict(do_resize=False, do_normalize=fam.mean is not None)
    if fam.mean is not None:
        kw.update(image_mean=list(fam.mean), image_std=list(fam.std))
    proc = getattr(transformers, fam.processor)(**kw)
    inputs = proc(images=image.permute(2, 0, 1), return_tensors="pt")
    with torch.no_grad():
        out = hf(**{k: v for k, v in inputs.items() if k == "pixel_values" or fam.pixel_mask})
    post = dict(threshold=-1.0, target_sizes=[original])
    if fam.processor in ("DeformableDetrImageProcessor", "ConditionalDetrImageProcessor", "RfDetrImageProcessor"):
        post["top_k"] = top_k
    res = proc.post_process_object_detection(out, **post)[0]
    return res["scores"], res["labels"], res["boxes"]


def _assert_same(got, want):
    """Same detections within TOL, in any order: random weights make near-tied scores, whose order
    (and whether the last ones make the top-k cut) a 1e-7 difference may swap, so the sorted
    scores are compared, and every detection above the cut must have a partner with the same
    label, score and box."""
    (gs, gl, gb), (ws, wl, wb) = got, want
    assert gs.shape == ws.shape
    torch.testing.assert_close(gs.sort().values, ws.sort().values, atol=TOL, rtol=0)
    box_tol = TOL * max(1.0, float(wb.abs().max()))
    match = ((wl.long()[:, None] == gl.long()[None, :]) & ((ws[:, None] - gs[None, :]).abs() <= TOL)
             & ((wb[:, None, :] - gb[None, :, :]).abs().amax(-1) <= box_tol))
    used = torch.zeros(len(gs), dtype=torch.bool)
    for i in torch.nonzero(ws > ws.min() + TOL).flatten().tolist():
        free = torch.nonzero(match[i] & ~used).flatten()
        assert len(free), f"detection {i} (label {int(wl[i])}, score {float(ws[i]):.6f}) has no partner"
        used[free[0]] = True


def _mmdet_predict(hf, family: str, image: torch.Tensor, original: tuple):
    from mmdet.structures import DetDataSample
    from mmdet.utils import register_all_modules

    from latte_plugin.mmdet import HFDetector

    register_all_modules()

    fam = FAMILIES[family]
    mean = [255 * m for m in fam.mean] if fam.mean else [0, 0, 0]
    std = [255 * s for s in fam.std] if fam.std else [255, 255, 255]
    det = HFDetector(family=family, hf_config=FAMILIES[family].architecture,
                     data_preprocessor=dict(type="DetDataPreprocessor", mean=mean, std=std, bgr_to_rgb=True,
                                            pad_size_divisor=32)).eval()
    det.hf.load_state_dict(hf.state_dict())
    side = image.shape[0]
    sample = DetDataSample(metainfo=dict(img_shape=(side, side), ori_shape=original,
                                         scale_factor=(side / original[1], side / original[0])))
    data = det.data_preprocessor({"inputs": [image.flip(-1).permute(2, 0, 1).contiguous()],
                                  "data_samples": [sample]}, False)
    with torch.no_grad():
        pred = det(**data, mode="predict")[0].pred_instances
    return pred.scores, pred.labels, pred.bboxes


def _detectron2_predict(hf, family: str, image: torch.Tensor, original: tuple):
    from latte_plugin.detectron2 import LatteHFDetector

    det = LatteHFDetector(family=family, hf_config=FAMILIES[family].architecture).eval()
    det.hf.load_state_dict(hf.state_dict())
    with torch.no_grad():
        inst = det.predict([{"image": image.flip(-1).permute(2, 0, 1).contiguous(), "height": original[0],
                             "width": original[1]}])[0]["instances"]
    return inst.scores, inst.pred_classes, inst.pred_boxes.tensor


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_wrappers_equal_transformers_own_pipeline(family):
    """mmdet's and detectron2's wrapper give the boxes and scores of transformers' image
    processor + model + ``post_process_object_detection`` within 1e-5, rescaled to an original
    image twice the input size, on the same weights and image."""
    side = FAMILIES[family].probe_size
    hf, image, original = _model(family), _image(side), (2 * side, 2 * side)
    top_k = FAMILIES[family].top_k or getattr(hf.config, "num_queries", None) or hf.config.num_detection_tokens
    want = _transformers_pipeline(family, hf, image, original, top_k)
    wrappers = [(m, run) for m, run in (("mmdet.models", _mmdet_predict), ("detectron2.structures", _detectron2_predict))
                if _importable(m)]
    if not wrappers:
        pytest.skip("neither mmdet nor detectron2 is installed")
    for _, run in wrappers:
        _assert_same(run(hf, family, image, original), want)


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("kind", ["sigmoid", "softmax"])
def test_postprocess_equals_its_naive_reference(kind):
    g = torch.Generator().manual_seed(0)
    logits, boxes = torch.randn(3, 12, 5, generator=g), torch.rand(3, 12, 4, generator=g)
    hw = [(64, 96), (32, 32), (128, 40)]
    for (s, lab, b), (rs, rl, rb) in zip(postprocess(kind, logits, boxes, hw, 7),
                                         naive_postprocess(kind, logits, boxes, hw, 7)):
        torch.testing.assert_close(s, rs)
        assert torch.equal(lab, rl)
        torch.testing.assert_close(b, rb, atol=1e-5, rtol=1e-6)


def test_every_architecture_json_names_a_family():
    names = {os.path.splitext(n)[0] for n in os.listdir(os.path.join(ROOT, "configs", "hf", "coco"))}
    assert names == {f.architecture for f in FAMILIES.values()}
