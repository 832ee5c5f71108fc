"""The one adapter protocol: every framework's adapter answers the same questions, the same
checks hold in each, and the public entry points have the same names and options."""
import inspect

import pytest
import torch

from latte_plugin.adapter import Adapter, TorchAdapter, take_batches
from tests.conftest import require


def _adapters():
    out = [("generic", TorchAdapter(), lambda n: {"x": torch.zeros(n, 3)})]
    try:
        require("mmdet.models")
        from latte_plugin.mmdet.calibrate import MMDetAdapter

        out.append(("mmdet", MMDetAdapter(), lambda n: {"inputs": [torch.zeros(3, 8, 8)] * n, "data_samples": []}))
    except pytest.skip.Exception:
        pass
    try:
        require("detectron2")
        from latte_plugin.detectron2.calibrate import Detectron2Adapter

        out.append(("detectron2", Detectron2Adapter(), lambda n: [{"image": torch.zeros(3, 8, 8)}] * n))
    except pytest.skip.Exception:
        pass
    return out


def test_every_adapter_implements_the_protocol_and_checks_the_same_things():
    names = [n for n, _, _ in _adapters()]
    assert "generic" in names
    for name, adapter, batch in _adapters():
        assert isinstance(adapter, Adapter)
        assert adapter.world() == (0, 1)
        t = torch.ones(3, dtype=torch.float64)
        assert adapter.all_reduce_sum(t) is t and torch.equal(t, torch.ones(3, dtype=torch.float64))
        size = adapter.batch_len(batch(4))
        assert size == (1 if name == "generic" else 4)  # the generic entry counts batches
        if size > 1:
            with pytest.raises(ValueError, match=f"smaller than the calibration batch size {size}"):
                take_batches([batch(4)], 2, 1, adapter.batch_len)
        with pytest.raises(ValueError, match="empty calibration set"):
            take_batches([], 2, 1, adapter.batch_len, adapter.data_hint)
        # an endless loader: an islice of this rank's share (3 of 5 images on 2 ranks)
        def endless():
            while True:
                yield batch(1)

        assert len(take_batches(endless(), 5, 2, adapter.batch_len)) == 3


def test_framework_entry_points_share_names_and_options():
    sigs = {}
    for mod in ("latte_plugin.mmdet", "latte_plugin.detectron2"):
        try:
            require(mod.split(".")[1] if mod.endswith("detectron2") else "mmdet.models")
            m = __import__(mod, fromlist=["calibrate_detector"])
            wf = __import__(mod + ".workflow", fromlist=["run_calibration"])
        except pytest.skip.Exception:
            continue
        sigs[mod] = (list(inspect.signature(m.calibrate_detector).parameters),
                     [p for p in inspect.signature(wf.run_calibration).parameters if p != "launcher"])
    if len(sigs) < 2:
        pytest.skip("needs both mmdet and detectron2 installed")
    a, b = sigs.values()
    assert a == b
