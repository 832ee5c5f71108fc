"""transformers' detectors through the plugin's one wrapper (mmdet ``HFDetector``, detectron2
``LatteHFDetector``): every family at the architecture of its smallest public COCO model
(random weights, small inputs) gives transformers' own boxes and scores, its candidates are
found from the model, RoPE layers see rotated q/k, and a biased attention is refused."""
import os

import pytest
import torch

from tests.conftest import ROOT, lively, require

require("transformers")
from latte_plugin.hf.detectors import FAMILIES, build_detector, naive_postprocess, postprocess  # noqa: E402

TOL = 1e-5


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return lively(build_detector(family, FAMILIES[family].architecture)).eval()


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
    names = {os.path.splitext(n)[0] for n in os.listdir(os.path.join(ROOT, "latte_plugin", "resources", "architectures"))}
    assert names == {f.architecture for f in FAMILIES.values()}


def test_hf_overrides_apply_on_top_of_an_architecture_file_too():
    from latte_plugin.hf.detectors import build_detector

    arch = os.path.join(ROOT, "configs", "hf", "deimv2_vit6_synthetic.json")
    model = build_detector("deimv2", arch, hf_overrides={"spatial_tuning_adapter_inplanes": 2, "num_labels": 3})
    assert model.config.spatial_tuning_adapter_inplanes == 2 and model.config.num_labels == 3
    assert model.model.conv_encoder.spatial_tuning_adapter.stem_conv.conv.out_channels == 2


#: (candidates with RoPE, other candidates, windowed, cross) each family's smallest public model has
EXPECTED_SITES = {
    "rt_detr": (0, 4, 0, 0), "rt_detr_v2": (0, 4, 0, 0), "d_fine": (0, 4, 0, 0),
    "deimv2": (12, 5, 0, 0),  # 12 DINOv3 blocks + AIFI + 4 decoder self-attention
    "lw_detr": (0, 6, 3, 0),  # 3 global ViT blocks + 3 decoder; blocks 0, 2, 4 windowed
    "rf_detr": (0, 5, 9, 0),  # blocks 3, 6, 9 global (+ 2 decoder); the other 9 windowed
    "yolos": (0, 12, 0, 0),
    "conditional_detr": (0, 12, 0, 6),  # 6 encoder + 6 decoder self; 6 decoder cross kept exact
    "deformable_detr": (0, 6, 0, 0),  # deformable encoder / cross-attention never dispatch: not listed
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_candidates_are_found_from_the_model(family):
    """One probe forward classifies every attention layer; ``candidates='auto'`` takes the global ones."""
    from latte_plugin.adapter import swap_attention
    from latte_plugin.nn.install import find_latte_layers

    require("detectron2.structures")
    from latte_plugin.detectron2 import LatteHFDetector

    det = LatteHFDetector(family=family, hf_config=FAMILIES[family].architecture).eval()
    names = swap_attention(det, ["auto"])
    sites = det.latte_sites
    kinds = [s.kind for s in sites]
    assert (kinds.count("global+rope"), kinds.count("global"), kinds.count("windowed"),
            kinds.count("cross")) == EXPECTED_SITES[family]
    assert names == [s.name for s in sites if s.candidate] == list(find_latte_layers(det))
    assert all(s.tokens > 0 and s.name.startswith("hf.") for s in sites)


def test_a_rope_layer_sees_rotated_q_and_k_and_is_exact_until_linearized():
    """DEIMv2's DINOv3 blocks: in exact mode the model is bit-identical; in linear mode the q and k
    the LATTE kernel receives are the rotated ones (``apply_rotary_pos_emb(q_proj(x), k_proj(x))``),
    not the raw projections."""
    from transformers.models.dinov3_vit import modeling_dinov3_vit as dv

    from latte_plugin.adapter import swap_attention

    hf, x = _model("deimv2"), torch.rand(1, 3, 128, 128)
    with torch.no_grad():
        want = hf(pixel_values=x).logits
    name = "model.conv_encoder.backbone.model.layer.5.attention"
    swap_attention(hf, ["model.conv_encoder.backbone.model.layer.*.attention"])
    with torch.no_grad():
        assert torch.equal(hf(pixel_values=x).logits, want)
    attn = dict(hf.named_modules())[name]
    seen, inputs = {}, {}
    attn.register_forward_pre_hook(lambda m, a, kw: inputs.update(h=a[0] if a else kw["hidden_states"],
                                                                 pe=kw["position_embeddings"]), with_kwargs=True)
    attend = attn.latte.attend
    attn.latte.attend = lambda q, k, v, *rest: (seen.update(q=q, k=k), attend(q, k, v, *rest))[1]
    attn.latte.mode = "linear"
    with torch.no_grad():
        out = hf(pixel_values=x).logits
        b, n, _ = inputs["h"].shape
        shape = (b, n, -1, attn.head_dim)
        q = attn.q_proj(inputs["h"]).view(shape).transpose(1, 2)
        k = attn.k_proj(inputs["h"]).view(shape).transpose(1, 2)
        rq, rk = dv.apply_rotary_pos_emb(q, k, *inputs["pe"])
    torch.testing.assert_close(seen["q"], rq, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(seen["k"], rk, atol=1e-6, rtol=1e-5)
    assert (rq - q).abs().max() > 1e-2  # the rotation is not the identity here
    assert not torch.equal(out, want)


def test_an_attention_with_an_additive_bias_is_refused_with_its_name():
    """A layer handed an additive bias (relative-position bias, ALiBi) is classified ``bias``, not a
    candidate; forced linear by pattern, it raises one line naming the layer instead of running."""
    from latte_plugin.adapter import swap_attention
    from latte_plugin.hf.discovery import discover_attention

    hf = _model("deimv2")
    attn = hf.model.conv_encoder.backbone.model.layer[0].attention
    h = torch.rand(1, 10, attn.q_proj.in_features)
    cos, sin = torch.ones(1, 10, attn.head_dim), torch.zeros(1, 10, attn.head_dim)
    bias = torch.randn(1, 1, 10, 10)
    holder = torch.nn.Module()
    holder.attn = attn
    call = lambda m: m.attn(h, attention_mask=bias, position_embeddings=(cos, sin))  # noqa: E731
    sites = discover_attention(holder, call, images=1)
    assert [s.kind for s in sites] == ["bias"] and not sites[0].candidate and "refused" in sites[0].reason
    swap_attention(holder, ["attn"])
    attn.latte.mode = "linear"
    with pytest.raises(ValueError, match=r"^attn: .*additive attention bias.*keep this layer exact"):
        call(holder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_loss_is_transformers_own_through_mmdet(family):
    """``HFDetector.loss`` returns transformers' total loss (finite, with gradients) and its terms."""
    require("mmdet.models")
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData

    from latte_plugin.mmdet import HFDetector

    side = FAMILIES[family].probe_size
    det = HFDetector(family=family, hf_config=FAMILIES[family].architecture).train()
    ds = DetDataSample(metainfo=dict(img_shape=(side, side)))
    ds.gt_instances = InstanceData(bboxes=torch.tensor([[10.0, 20.0, 60.0, 90.0]]), labels=torch.tensor([3]))
    torch.manual_seed(0)
    logs = det.loss(torch.rand(1, 3, side, side), [ds])
    assert torch.isfinite(logs["loss"]) and logs["loss"].requires_grad
    assert len(logs) > 1 and all(not v.requires_grad for k, v in logs.items() if k != "loss")
