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
        # a batch is split into single images (the generic entry cannot split: one batch, one item)
        parts = adapter.split(batch(4))
        assert len(parts) == (1 if name == "generic" else 4)
        if name != "generic":
            # fewer images asked for than one batch holds: exactly those, one per batch
            got, pos = take_batches([batch(4)], 2, (0, 1), adapter)
            assert len(got) == 2 and pos == [0, 1]
        with pytest.raises(ValueError, match="empty calibration set"):
            take_batches([], 2, (0, 1), adapter)
        # an endless loader: an islice of this rank's share (images 1 and 3 of 5 on rank 1 of 2)
        def endless():
            while True:
                yield batch(1)

        got, pos = take_batches(endless(), 5, (1, 2), adapter)
        assert len(got) == 2 and pos == [1, 3]
        got, pos = take_batches(endless(), 5, (0, 2), adapter)
        assert len(got) == 3 and pos == [0, 2, 4]


def test_calibration_images_do_not_depend_on_world_size_or_batch_size():
    """Batches of 2 dealt round-robin to 2 ranks, 5 images asked for: the positions of every
    rank together are exactly 0..4, and each image keeps its global position."""

    class Tagged(Adapter):
        def split(self, batch):
            return [[x] for x in batch]

    adapter = Tagged()
    stream = list(range(40))  # global sample order (e.g. a seeded shuffle); sample value = its position
    for world in (1, 2, 3):
        seen = {}
        for rank in range(world):
            local = stream[rank::world]
            loader = [local[i:i + 2] for i in range(0, len(local), 2)]  # calib_batch_size=2
            got, pos = take_batches(loader, 5, (rank, world), adapter)
            assert [b[0] for b in got] == pos  # the image at each position is the one the sampler put there
            seen.update(dict.fromkeys(pos))
        assert sorted(seen) == [0, 1, 2, 3, 4], world


def test_contiguous_blocks_per_rank_take_the_same_images():
    """detectron2's InferenceSampler: rank r holds a contiguous block of dataset indices; with
    40 images, 2 ranks and 16 asked for, rank 0 takes 0..15 and rank 1 none."""

    class Blocks(Adapter):
        def __init__(self, local):
            self.local = local

        def split(self, batch):
            return [[x] for x in batch]

        def sample_positions(self, data):
            return self.local

    for world in (1, 2):
        per = 40 // world
        seen = []
        for rank in range(world):
            local = list(range(rank * per, (rank + 1) * per))
            got, pos = take_batches([[i] for i in local], 16, (rank, world), Blocks(local))
            seen += pos
        assert sorted(seen) == list(range(16))


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
