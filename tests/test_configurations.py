"""Whole configurations judged end to end by cross-fitting, and the noise rule (issue 26).

* a constructed model where a search measured with in-sample corrections is fooled (a wide
  layer whose refit memorises the few calibration rows) and the cross-fitted search is not;
* the paper's protocol is kept when it is the better configuration end to end;
* the noise rule keeps the paper's choice on a near-tie and moves away on a clear gain;
* ``target=`` is re-judged after compensation.
"""
import math

import pytest
import torch
from torch import nn

from latte_plugin.calibration.config import LatteConfig
from latte_plugin.calibration.context import Host
from latte_plugin.calibration.flow import calibrate_model
from latte_plugin.nn.install import find_latte_layers
from latte_plugin.nn.mha import swap_mha
from latte_plugin.calibration.select import NOISE_Z, choose_configuration, naive_paired_gain, paired_gain
from latte_plugin.calibration.measures import RawDistortion
from latte_plugin.calibration.judge import Verdict, configuration_judge, output_distortion
from tests.toy import ToyEncoder, toy_batches


class TwoBranch(nn.Module):
    """Two attention branches summed into the output: ``a.attn`` is wide (96 channels: its
    ridge refit has 97 weights per channel, more than the 64 rows 8 images record), ``b.attn``
    narrow (16 channels)."""

    def __init__(self, dim: int = 16, wide: int = 96, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = nn.Linear(dim, wide)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.attn = nn.MultiheadAttention(wide, 4, batch_first=True)
        self.b.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head_a, self.head_b = nn.Linear(wide, 5), nn.Linear(dim, 5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))

    def forward(self, x):
        h = self.up(x)
        return self.head_a(self.a.attn(h, h, h)[0]) + self.head_b(self.b.attn(x, x, x)[0])


def _sequences(n: int, seed: int, tokens: int = 8, dim: int = 16) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, tokens, dim, generator=g) for _ in range(n)]


@torch.no_grad()
def test_a_search_fooled_by_in_sample_corrections_is_not_fooled_when_cross_fitted():
    """Measured with the corrections fitted on the very images that measure it (what the greedy
    search did before), the wide layer looks the better one to make linear: its refit
    memorises the 64 recorded rows. On 64 other sequences it is by far the worse. The
    greedy search, measuring each image with corrections fitted without its fold, picks the
    narrow layer."""
    model = TwoBranch().eval()
    swap_mha(model, ["a.attn", "b.attn"])
    calibration, fresh = _sequences(8, seed=1), _sequences(64, seed=2)
    cfg = LatteConfig(candidates=["a.attn", "b.attn"], num_linear=1, selection="greedy", correction="refit",
                      refit_reg=(1e-4,), compensate="never", greedy_images=8, steps=5, max_queries=8)
    rep = calibrate_model(model, calibration, lambda b: model(b), cfg, log=lambda s: None)
    layers = find_latte_layers(model)
    in_sample = output_distortion(layers, list(enumerate(calibration)), lambda b: model(b), lambda t: t)
    out_of_sample = output_distortion(layers, list(enumerate(fresh)), lambda b: model(b), lambda t: t)
    assert in_sample(["a.attn"]) < 0.5 * in_sample(["b.attn"])  # the in-sample measure is fooled
    assert out_of_sample(["a.attn"]) > 10 * out_of_sample(["b.attn"])  # ... by a layer that generalises badly
    assert rep["linearized"] == ["b.attn"] and rep["selection"]["greedy_images"] == 8


def _run_toy(**kw):
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    rep = calibrate_model(model, toy_batches(n=16), lambda b: model(b),
                          LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, **kw), log=lambda s: None)
    return model, rep


@torch.no_grad()
def test_the_papers_protocol_is_kept_when_it_is_the_better_configuration(monkeypatch):
    """Layer 0's attention is made very peaked (its linear form is poor), and the searches are
    made to return the score's set with layer 0 swapped in: the paper's score set is then the
    better configuration end to end. It is the one applied, and it is better on inputs no
    step of the calibration saw."""
    import latte_plugin.calibration.flow as flow

    real = flow.candidate_sets

    def searches_take_layer_0(methods, layers, sens, ks, distortion):
        sets, traces = real(methods, layers, sens, ks, distortion)
        for k in ks:
            bad = ["layers.0.attn"] + [n for n in sets.get(("score", k), list(layers)) if n != "layers.0.attn"][: k - 1]
            sets.update({(m, k): [n for n in layers if n in bad] for m in methods if m != "score"})
        return sets, traces

    monkeypatch.setattr(flow, "candidate_sets", searches_take_layer_0)
    model = ToyEncoder().eval()
    model.layers[0].attn.in_proj_weight[: 2 * 32] *= 6.0  # queries and keys: a sharp softmax
    swap_mha(model, ["layers.*.attn"])
    rep = calibrate_model(model, toy_batches(n=16), lambda b: model(b),
                          LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, ratio=0.5,
                                      correction="sigma", compensate="never"), log=lambda s: None)
    cmp = rep["selection"]["comparison"]
    assert "layers.0.attn" not in rep["linearized"]
    # the reference (the evidence's greedy, with the user's sigma) loses clearly: the rule moves to the paper's
    assert cmp["reference"] == "greedy+sigma" and "score+sigma" == rep["selection"]["configuration"] == cmp["best"]
    assert cmp["losses"]["score+sigma"] < cmp["losses"]["greedy+sigma"]
    layers = find_latte_layers(model)
    after = output_distortion(layers, list(enumerate(toy_batches(n=8, seed=5))), lambda b: model(b), lambda t: t)
    searched = cmp["layers"]["greedy+sigma"][0]
    assert "layers.0.attn" in searched and after(rep["linearized"]) < after(searched)


def _verdicts(ref: list, other: list) -> dict:
    t = torch.tensor
    return {"score+sigma": Verdict(float(sum(ref) / len(ref)), t(ref, dtype=torch.float64)),
            "greedy+auto": Verdict(float(sum(other) / len(other)), t(other, dtype=torch.float64))}


def test_the_noise_rule_keeps_the_papers_choice_on_a_near_tie_and_moves_on_a_clear_gain():
    # near tie: the other is lower on average, but its per-image gains are mostly noise
    ref = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    noisy = [0.5, 2.6, 2.4, 4.7, 4.3, 6.1]
    chosen, info = choose_configuration(_verdicts(ref, noisy))
    assert info["best"] == "greedy+auto" and info["gain"] > 0 and info["gain"] < NOISE_Z * info["standard_error"]
    assert chosen == "score+sigma"
    # a clear gain: lower on every image
    chosen, info = choose_configuration(_verdicts(ref, [r * 0.8 for r in ref]))
    assert chosen == "greedy+auto" and info["gain"] > NOISE_Z * info["standard_error"]
    # exact ties and a single image keep the reference (no noise estimate from one image)
    assert choose_configuration(_verdicts(ref, ref))[0] == "score+sigma"
    assert choose_configuration(_verdicts([1.0], [0.1]))[0] == "score+sigma"
    # the paper's own win
    assert choose_configuration(_verdicts([0.1] * 3, [1.0, 2.0, 3.0]))[0] == "score+sigma"


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_paired_gain_matches_its_naive_reference(n):
    g = torch.Generator().manual_seed(n)
    ref, cand = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    mean, se = paired_gain(ref, cand)
    nmean, nse = naive_paired_gain(ref.tolist(), cand.tolist())
    assert mean == pytest.approx(nmean, rel=1e-12, abs=1e-15)
    assert (math.isinf(se) and math.isinf(nse)) or se == pytest.approx(nse, rel=1e-12)


@torch.no_grad()
def test_a_near_tie_on_the_toy_encoder_keeps_the_reference():
    """Every configuration with the same linear set and rule ties: the reference is kept."""
    _, rep = _run_toy(ratio=0.5, correction="sigma", selection="auto", compensate="never")
    cmp = rep["selection"]["comparison"]
    same = [n for n, v in cmp["losses"].items() if v == cmp["losses"][cmp["reference"]]]
    assert cmp["reference"] == "greedy+sigma"  # the evidence reference with the user's rule
    if cmp["best"] in same:
        assert rep["selection"]["configuration"] == cmp["reference"]
    assert rep["selection"]["configuration"] in (cmp["reference"], cmp["best"])


@pytest.mark.parametrize("target_loss, kept", [(0.04, True), (0.07, False)])
def test_a_compensation_that_breaks_the_target_is_dropped(monkeypatch, target_loss, kept):
    """compensate='auto' with target=0.05: a compensation that lowers the cross-fitted output
    error is kept only if the compensated model's fidelity loss is still within the target."""
    import latte_plugin.calibration.flow as flow
    from latte_plugin.calibration.select import Configuration

    def verdict(halves, measure, corrections, key, layers):
        if measure.name == "fidelity":
            return Verdict(target_loss, torch.full((8,), target_loss))
        loss = 0.5 if key.endswith("+compensation") else 1.0  # half the loss on each of 8 images: a clear gain
        return Verdict(loss, torch.tensor([loss * (1 + 0.01 * i * (-1) ** i) for i in range(8)]))

    monkeypatch.setattr(flow, "on_every_image", verdict)
    monkeypatch.setattr(flow, "compensate_layers", lambda run, chosen, targets: ({"a": {}}, {"a": "compensated"}))

    class Fidelity:
        name = "fidelity"

    class Run:
        cfg = LatteConfig(target=0.05)
        forward = staticmethod(lambda b: b)
        judge = RawDistortion(lambda b: b, relative=False)
        fidelity = Fidelity()

        @staticmethod
        def log(line):
            pass

    from latte_plugin.calibration.corrections import CorrectionTable

    chosen = Configuration("greedy", "auto", ["a"], k=1)
    fitted = flow._Fitted({"a": {}}, CorrectionTable({"auto": {"a": "plain"}}), {}, [], [1])
    out, table, comp_fits, info = flow._choose_compensation(Run(), chosen, fitted)
    assert dict(table["auto+compensation"]) == {"a": "compensated"} and "auto+compensation" not in fitted.corrections
    assert info["crossfit_distortion"] == {"plain": 1.0, "compensated": 0.5} and info["target_loss"] == target_loss
    assert info["kept"] is kept and out.compensated is kept and out.layers == ["a"]


@torch.no_grad()
def test_target_is_rejudged_after_compensation():
    """With target= and compensate='auto', a kept compensation's fidelity loss is within the target."""
    _, rep = _run_toy(target=0.05, correction="refit", refit_reg=(0.01,))
    sel = rep["selection"]
    comp = sel.get("compensation")
    if comp is not None and "target_loss" in comp:
        assert comp["kept"] == (comp["target_loss"] <= 0.05 and comp["gain"] > comp["z"] * comp["standard_error"])
    assert sel["k"] == len(rep["linearized"])
    if rep["linearized"]:
        assert sel["heldout"]["kind"] == "cross-fitted"


def _same(a, b, path="report"):
    """Recursive equality of two reports (floats to 1e-9 relative: the same operations in the same order)."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(set(a) ^ set(b))}"
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=0, msg=path)
    elif isinstance(a, float) and not (math.isnan(a) and math.isnan(b)):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), path
    elif not isinstance(a, float):
        assert a == b, f"{path}: {a!r} vs {b!r}"


@torch.no_grad()
def test_several_ratios_in_one_calibration_equal_separate_calibrations():
    """``calibrate_model_ratios`` shares the split, the fits, the scores and the searches between
    linear shares: each share's report, calibrated state and outputs equal a separate
    ``calibrate_model`` with that ratio (package defaults otherwise: every selection and rule
    compared, compensation judged)."""
    from latte_plugin.calibration.flow import calibrate_model_ratios

    ratios = (0.5, 0.83)
    probe = toy_batches(n=2, seed=7)

    def fresh():
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"])
        return model

    def settings(**kw):
        return LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, **kw)

    alone = []
    for r in ratios:
        model = fresh()
        rep = calibrate_model(model, toy_batches(n=16), lambda b: model(b), settings(ratio=r), log=lambda s: None)
        alone.append((rep, model.state_dict(), [model(x) for x in probe]))
    model = fresh()
    shared = calibrate_model_ratios(model, toy_batches(n=16), Host(lambda b: model(b), log=lambda s: None), settings(), ratios)
    for (rep, state, outs), got in zip(alone, shared):
        _same(rep, got)
        _same(state, model.state_dict(), "state")
        for o, x in zip(outs, probe):
            torch.testing.assert_close(model(x), o, rtol=0, atol=0)
    assert [len(a[0]["linearized"]) for a in alone] == [3, 5]
    with pytest.raises(ValueError, match="target"):
        next(calibrate_model_ratios(model, toy_batches(n=4), Host(lambda b: model(b)), settings(target=0.05), ratios))


class _FirstToken(RawDistortion):
    """A measure that only looks at the first token's output (stands in for a detector's
    detections: a different view of the same outputs than the raw MSE over every token)."""

    name = "first-token MSE"

    def __init__(self, forward):
        super().__init__(lambda b: forward(b)[:, :1], relative=False)
        self.name = "first-token MSE"


def test_configuration_judge_follows_the_setting():
    fwd = lambda b: b  # noqa: E731
    det = _FirstToken(fwd)
    assert configuration_judge(LatteConfig(judge="outputs"), fwd, det).name == "raw-output MSE"
    assert configuration_judge(LatteConfig(judge="detections"), fwd, det) is det
    assert configuration_judge(LatteConfig(judge="auto"), fwd, det) is det
    assert configuration_judge(LatteConfig(judge="auto"), fwd, None).name == "raw-output MSE"
    with pytest.raises(ValueError, match="judge='detections' needs a detector"):
        configuration_judge(LatteConfig(judge="detections"), fwd, None)
    with pytest.raises(ValueError, match="judge must be one of"):
        LatteConfig(judge="mAP").validate()


@torch.no_grad()
@pytest.mark.parametrize("judge", ["outputs", "detections"])
def test_the_judge_setting_decides_what_compares_configurations_and_compensation(judge):
    """The configurations' losses and the compensation's are the judge's: with ``detections``
    the detector's measure (here a stand-in), with ``outputs`` the raw-output MSE; the chosen
    configuration is the reference or the judge's best."""
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    measure = _FirstToken(lambda b: model(b))
    rep = calibrate_model(model, toy_batches(n=16), lambda b: model(b),
                          LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, judge=judge,
                                      compensate="always"), log=lambda s: None, fidelity=measure)
    sel = rep["selection"]
    name = measure.name if judge == "detections" else "raw-output MSE"
    assert sel["measure"] == name and sel["compensation"]["measure"] == name
    cmp = sel["comparison"]
    assert sel["configuration"].removesuffix("+compensation") in (cmp["reference"], cmp["best"])
    assert cmp["best"] == min(cmp["losses"], key=cmp["losses"].get)


def _disagreeing_searches(monkeypatch):
    """The first half's search and the search run again take the sharp layer 0 (two different
    sets); the second half's search does not."""
    import latte_plugin.calibration.flow as flow

    real, calls = flow.candidate_sets, []

    def searches(methods, layers, sens, ks, distortion):
        sets, traces = real(methods, layers, sens, ks, distortion)
        calls.append(ks)
        picks = {1: ["layers.0.attn", "layers.1.attn", "layers.2.attn"], 2: ["layers.3.attn", "layers.4.attn",
                 "layers.5.attn"], 3: ["layers.0.attn", "layers.4.attn", "layers.5.attn"]}[min(len(calls), 3)]
        sets.update({(m, k): [n for n in layers if n in picks] for m in methods if m != "score" for k in ks})
        return sets, traces

    monkeypatch.setattr(flow, "candidate_sets", searches)
    return calls


def _calibrated_with_a_sharp_layer(final_set: str):
    """A toy encoder whose layer 0 is sharp (its linear form is poor), calibrated on 16 images with
    4 searched per half, half its layers linear by greedy search: ``(model, report)``."""
    model = ToyEncoder().eval()
    model.layers[0].attn.in_proj_weight[: 2 * 32] *= 6.0
    swap_mha(model, ["layers.*.attn"])
    cfg = LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, ratio=0.5, selection="greedy",
                      compensate="never", final_set=final_set)
    return model, calibrate_model(model, toy_batches(n=16), lambda b: model(b), cfg, log=lambda s: None)


@torch.no_grad()
@pytest.mark.parametrize("final_set", ["confirm", "search"])
def test_the_final_set_is_confirmed_on_images_no_search_saw(monkeypatch, final_set):
    """Layer 0 is sharp (its linear form is poor). The halves' searches disagree, and the search
    run again takes layer 0. Judged on the 12 images neither search compared outputs on, the
    second half's set (without layer 0) is kept under ``final_set='confirm'``, and it is better
    on inputs no step saw; ``final_set='search'`` keeps the set searched again (the rule before)."""
    calls = _disagreeing_searches(monkeypatch)
    model, rep = _calibrated_with_a_sharp_layer(final_set)
    sel = rep["selection"]
    assert len(calls) == 3 and sel["searched_again"]
    searched_again = ["layers.0.attn", "layers.4.attn", "layers.5.attn"]
    if final_set == "search":
        assert rep["linearized"] == searched_again and "confirmed" not in sel
        return
    confirmed = sel["confirmed"]
    assert confirmed["images"] == 12 and confirmed["sets"][0] == searched_again and len(confirmed["sets"]) == 3
    assert rep["linearized"] == ["layers.3.attn", "layers.4.attn", "layers.5.attn"] == confirmed["sets"][confirmed["kept"]]
    assert min(confirmed["losses"]) == confirmed["losses"][confirmed["kept"]] < confirmed["losses"][0]
    layers = find_latte_layers(model)
    fresh = output_distortion(layers, list(enumerate(toy_batches(n=8, seed=5))), lambda b: model(b), lambda t: t)
    assert fresh(rep["linearized"]) < fresh(searched_again)


def _agreeing_searches(monkeypatch, again: list):
    """Both halves' searches take the sharp layer 0; the search run again takes ``again``."""
    import latte_plugin.calibration.flow as flow

    real, calls = flow.candidate_sets, []

    def searches(methods, layers, sens, ks, distortion):
        sets, traces = real(methods, layers, sens, ks, distortion)
        calls.append(ks)
        picks = ["layers.0.attn", "layers.4.attn", "layers.5.attn"] if len(calls) < 3 else again
        sets.update({(m, k): [n for n in layers if n in picks] for m in methods if m != "score" for k in ks})
        return sets, traces

    monkeypatch.setattr(flow, "candidate_sets", searches)
    return calls


@torch.no_grad()
@pytest.mark.parametrize("final_set,again", [("confirm", None), ("pooled", ["layers.3.attn", "layers.4.attn", "layers.5.attn"]),
                                             ("pooled", ["layers.0.attn", "layers.4.attn", "layers.5.attn"])])
def test_pooled_searches_again_where_the_halves_agree(monkeypatch, final_set, again):
    """The halves agree on a set with the sharp layer 0. ``confirm`` keeps it without another search;
    ``pooled`` searches again on every search image and, where that set differs, keeps the one
    of lower loss on the 12 unsearched images (here the set without layer 0, better on fresh
    inputs too); where it is the same set, nothing is judged."""
    calls = _agreeing_searches(monkeypatch, again)
    model, rep = _calibrated_with_a_sharp_layer(final_set)
    sel, agreed = rep["selection"], ["layers.0.attn", "layers.4.attn", "layers.5.attn"]
    if again is None:
        assert len(calls) == 2 and rep["linearized"] == agreed and "searched_again" not in sel
        return
    assert len(calls) == 3 and "pooled" in sel["searched_again"]
    confirmed = sel["confirmed"]
    if again == agreed:
        assert confirmed["sets"] == [agreed] and confirmed["losses"] is None and rep["linearized"] == agreed
        return
    assert confirmed["images"] == 12 and confirmed["sets"] == [again, agreed]
    assert rep["linearized"] == again and confirmed["losses"][0] < confirmed["losses"][1]
    fresh = output_distortion(find_latte_layers(model), list(enumerate(toy_batches(n=8, seed=5))),
                              lambda b: model(b), lambda t: t)
    assert fresh(again) < fresh(agreed)


@torch.no_grad()
def test_with_no_unsearched_image_the_set_searched_again_is_kept(monkeypatch):
    """8 images, 4 searched per half: nothing is left to confirm on, and the rule is the one before."""
    _disagreeing_searches(monkeypatch)
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    cfg = LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=8, ratio=0.5, selection="greedy",
                      compensate="never")
    rep = calibrate_model(model, toy_batches(n=8), lambda b: model(b), cfg, log=lambda s: None)
    assert rep["selection"]["confirmed"]["images"] == 0 and rep["selection"]["confirmed"]["kept"] == 0
    assert rep["linearized"] == ["layers.0.attn", "layers.4.attn", "layers.5.attn"]
