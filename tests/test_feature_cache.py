"""The backbone-feature cache of mmdet's calibration forward: exact where it serves, off where
it would not be (grad, train mode, candidates in the backbone, another extract_feat)."""
import itertools

import pytest
import torch

from tests.conftest import require, tiny_cfg

require("mmdet.models")
import latte_plugin.mmdet  # noqa: E402,F401

from latte_plugin.calibration.config import LatteConfig
from latte_plugin.mmdet.calibrate import (ADAPTER, build_calibration_loader, detector_forward, detector_predict,
                                         install_latte_cores)
from latte_plugin.mmdet.feature_cache import FeatureCache, cache_site
from latte_plugin.nn.install import find_latte_layers


@pytest.fixture(scope="module")
def detr_and_batches(synthetic_data, tmp_path_factory):
    from mmengine.runner import Runner

    cfg = tiny_cfg(synthetic_data, str(tmp_path_factory.mktemp("cache")), calibrate="never")
    model = ADAPTER.unwrap(Runner.from_cfg(cfg).model).eval()
    assert len(install_latte_cores(model, LatteConfig(candidates=["encoder.layers.*.self_attn"]))) == 6
    batches = [s for b in itertools.islice(build_calibration_loader(cfg), 2) for s in ADAPTER.split(b)]
    return model, batches


def _outputs_equal(a, b) -> bool:
    a, b = (list(x) if isinstance(x, (tuple, list)) else [x] for x in (a, b))
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@torch.no_grad()
def test_cached_forward_equals_the_whole_network_and_runs_the_backbone_once(detr_and_batches):
    model, batches = detr_and_batches
    assert cache_site(model) == (model, "extract_feat")
    calls = []
    handle = model.backbone.register_forward_hook(lambda *_: calls.append(1))
    try:
        forward = detector_forward(model)
        for batch in batches:
            first, again, whole = forward(batch), forward(batch), forward.uncached(batch)
            assert _outputs_equal(first, whole) and _outputs_equal(again, whole)
        assert len(calls) == 2 * len(batches)  # one cached run + one uncached run per batch
        layer = next(iter(find_latte_layers(model).values()))
        layer.mode = "linear"  # a transformer layer changes: the cached path must see it
        try:
            changed = forward(batches[0])
            assert _outputs_equal(changed, forward.uncached(batches[0]))
            assert not _outputs_equal(changed, first)  # and it did change the outputs
        finally:
            layer.mode = "exact"
        assert "extract_feat" not in model.__dict__  # the method is back
        got = detector_predict(model)(batches[0])
        want = detector_predict(model, FeatureCache(torch.nn.Linear(1, 1)))(batches[0])  # unusable cache: no serving
        assert all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))
    finally:
        handle.remove()


def test_no_cache_with_grad_in_train_mode_or_candidates_in_the_backbone(detr_and_batches, monkeypatch):
    model, batches = detr_and_batches
    cache = FeatureCache(model)
    with torch.enable_grad(), cache.serving(batches[0]["inputs"]):
        assert "extract_feat" not in model.__dict__
    model.train()
    try:
        with torch.no_grad(), cache.serving(batches[0]["inputs"]):
            assert "extract_feat" not in model.__dict__
    finally:
        model.eval()
    import latte_plugin.mmdet.feature_cache as fc

    monkeypatch.setattr(fc, "find_latte_layers", lambda m: {"backbone.layer1.attn": None})
    assert cache_site(model) is None
    assert cache_site(torch.nn.Linear(2, 2)) is None


@torch.no_grad()
def test_the_hf_wrappers_cache_their_backbone(tmp_path):
    """RT-DETR through the HF wrapper: the backbone runs once per batch, outputs equal the whole network's."""
    require("transformers")
    from mmdet.structures import DetDataSample
    from mmdet.utils import register_all_modules

    from latte_plugin.hf.detectors import FAMILIES
    from latte_plugin.mmdet import HFDetector

    register_all_modules()
    torch.manual_seed(0)
    det = HFDetector(family="rt_detr", hf_config=FAMILIES["rt_detr"].architecture,
                     data_preprocessor=dict(type="DetDataPreprocessor", mean=[0, 0, 0], std=[255, 255, 255])).eval()
    install_latte_cores(det, LatteConfig(candidates=det.latte_candidates()))
    assert cache_site(det) == (det.hf.model.backbone, "forward")
    g = torch.Generator().manual_seed(0)
    batch = {"inputs": [torch.randint(0, 256, (3, 160, 160), generator=g, dtype=torch.uint8)],
             "data_samples": [DetDataSample(metainfo=dict(img_shape=(160, 160), ori_shape=(160, 160), scale_factor=(1, 1)))]}
    calls = []
    inner = next(det.hf.model.backbone.children())  # the wrapper's own hooks fire on a cached call too
    handle = inner.register_forward_hook(lambda *_: calls.append(1))
    try:
        forward = detector_forward(det)
        first, again, whole = forward(batch), forward(batch), forward.uncached(batch)
    finally:
        handle.remove()
    assert _outputs_equal(first, whole) and _outputs_equal(again, whole) and len(calls) == 2
    assert "forward" not in det.hf.model.backbone.__dict__
