"""The recording's two savings leave every figure as it was (``docs/architecture.md#recording``).

* A one-layer recording of a layer seen to run once per forward stops the forward after it:
  the items are the same, and the layers after it do not run.
* A layer that runs twice per forward is never stopped after.
* Shares whose chosen sets begin alike reuse the compensation refits of that beginning, and a
  whole calibration gives the same report and state with and without either saving.
"""
import math

import pytest
import torch
from torch import nn

import latte_plugin.calibration.record as recording
from latte_plugin.calibration.config import LatteConfig
from latte_plugin.calibration.flow import calibrate_model, calibrate_model_ratios
from latte_plugin.nn.install import find_latte_layers
from latte_plugin.nn.mha import swap_mha
from latte_plugin.calibration.record import LayerRecorder, RecordingDone
from latte_plugin.calibration.context import Host, no_reduce
from latte_plugin.calibration.flow import _start
from tests.toy import Block, ToyEncoder, toy_batches

NAMES = [f"layers.{i}.attn" for i in range(6)]


class SharedBlock(nn.Module):
    """One block run twice per forward (weights shared), then a head."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block(dim, 4)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


def _run(model, cfg):
    batches = toy_batches(n=8)
    return _start(model, batches, Host(lambda b: model(b), log=lambda s: None), cfg)


def _count_calls(module: nn.Module) -> list:
    calls = []
    module.register_forward_hook(lambda m, a, o: calls.append(1))
    return calls


def _items(recs, name):
    return [(it.key, it.q, it.k, it.v, it.target) for role in recs for it in recs[role][name].items]


def _same_items(a, b):
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert x[0] == y[0]
        for s, t in zip(x[1:], y[1:]):
            torch.testing.assert_close(s, t, rtol=0, atol=0)


@torch.no_grad()
def test_a_one_layer_recording_stops_after_a_layer_that_runs_once_and_records_the_same():
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    run = _run(model, LatteConfig(candidates=["layers.*.attn"]))
    head_calls = _count_calls(model.head)
    everything = recording.record_layers(run, NAMES, "recording")
    assert run.caches.runs_once == set(NAMES)
    forwards = len(head_calls)
    assert forwards == sum(len(getattr(run.split, r)) for r in everything) > 0

    head_calls.clear()
    stopped = recording.record_layers(run, ["layers.2.attn"], "one layer")
    assert len(head_calls) == 0, "the forward went on past the recorded layer"
    run.caches.runs_once.clear()
    full = recording.record_layers(run, ["layers.2.attn"], "one layer")
    assert len(head_calls) == forwards
    _same_items(_items(stopped, "layers.2.attn"), _items(full, "layers.2.attn"))


@torch.no_grad()
def test_a_layer_that_runs_twice_per_forward_is_recorded_to_the_end():
    model = SharedBlock().eval()
    swap_mha(model, ["block.attn"])
    run = _run(model, LatteConfig(candidates=["block.attn"]))
    other = LayerRecorder("other")  # a second recorder so the all-layer rule applies to a group
    recs = recording.record_layers(run, ["block.attn"], "recording")
    assert run.caches.runs_once == set()
    run.caches.runs_once |= recording.runs_once({"fit": {"block.attn": recs["fit"]["block.attn"], "x": other},
                                          "choose": {"block.attn": recs["choose"]["block.attn"], "x": other},
                                          "report": {"block.attn": recs["report"]["block.attn"], "x": other}},
                                         forwards=8, all_reduce=no_reduce)
    assert "block.attn" not in run.caches.runs_once
    assert any(recs[r]["block.attn"].repeated for r in recs)
    head_calls = _count_calls(model.head)
    recording.record_layers(run, ["block.attn"], "one layer")
    assert len(head_calls) == 8


@torch.no_grad()
def test_a_single_candidate_is_learnt_from_its_own_full_recording():
    model = ToyEncoder(depth=2).eval()
    swap_mha(model, ["layers.1.attn"])
    run = _run(model, LatteConfig(candidates=["layers.1.attn"]))
    recording.record_layers(run, ["layers.1.attn"], "recording")
    assert run.caches.runs_once == {"layers.1.attn"}
    head_calls = _count_calls(model.head)
    recording.record_layers(run, ["layers.1.attn"], "one layer")
    assert len(head_calls) == 0


def test_a_stopping_recorder_raises_after_recording_its_batch():
    rec = LayerRecorder("l", stop_after=True)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RecordingDone):
        rec(q, q, q, None, q)
    assert len(rec.items) == 1 and rec.calls == 1 and not rec.repeated


def _calibrate(ratios, monkeypatch=None, **kw):
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    cfg = LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, compensate="always", **kw)
    reps = list(calibrate_model_ratios(model, toy_batches(n=16), Host(lambda b: model(b), log=lambda s: None), cfg, ratios))
    return reps, model


def _same(a, b, path="report"):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=path)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


@torch.no_grad()
def test_shares_reuse_the_compensation_of_their_common_beginning_and_nothing_changes(monkeypatch):
    """Two shares with compensation always on: the second share refits only the layers from
    the first difference on; with both savings switched off (no layer runs once, nothing
    remembered) every report and the final state are bit for bit the same."""
    refits = []
    import latte_plugin.calibration.compensate as compensate

    real = compensate._compensate_layer
    monkeypatch.setattr(compensate, "_compensate_layer", lambda run, n, rule, t: refits.append(n) or real(run, n, rule, t))
    reps, model = _calibrate((0.5, 0.83), selection="score")  # nested sets: 3 layers, then those and 2 more
    first, second = (r["linearized"] for r in reps)
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    assert common == 3 and len(refits) == len(first) + len(second) - common
    assert all(r["selection"]["compensation"]["kept"] for r in reps)

    monkeypatch.setattr(recording, "runs_once", lambda recs, forwards, all_reduce: set())
    import latte_plugin.calibration.flow as flow

    monkeypatch.setattr(flow, "compensate_layers", _without_memory(flow.compensate_layers))
    plain, plain_model = _calibrate((0.5, 0.83), selection="score")
    for a, b in zip(plain, reps):
        _same(a, b)
    _same(plain_model.state_dict(), model.state_dict(), "state")
    assert find_latte_layers(model)


def _without_memory(compensate):
    def forgetful(run, chosen, targets):
        run.caches.compensated.clear()
        return compensate(run, chosen, targets)
    return forgetful


@torch.no_grad()
def test_one_calibration_is_the_same_with_and_without_stopping_early(monkeypatch):
    def once():
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"])
        rep = calibrate_model(model, toy_batches(n=16), lambda b: model(b),
                              LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, ratio=0.67,
                                          compensate="always"), log=lambda s: None)
        return rep, model.state_dict()

    rep, state = once()
    monkeypatch.setattr(recording, "runs_once", lambda recs, forwards, all_reduce: set())
    rep0, state0 = once()
    _same(rep0, rep)
    _same(state0, state, "state")
