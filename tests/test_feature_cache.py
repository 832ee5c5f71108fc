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
from latte_plugin.mmdet.feature_cache import FeatureCache, backbone_is_fixed
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
    flat = lambda x: [t for t in (x if isinstance(x, (tuple, list)) else [x])]  # noqa: E731
    return all(torch.equal(p, q) for p, q in zip(flat(a), flat(b), strict=True))


@torch.no_grad()
def test_cached_forward_equals_the_whole_network_and_runs_the_backbone_once(detr_and_batches):
    model, batches = detr_and_batches
    assert backbone_is_fixed(model)
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
    assert not backbone_is_fixed(model)
    assert not backbone_is_fixed(torch.nn.Linear(2, 2))
