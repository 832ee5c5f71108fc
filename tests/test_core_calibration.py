"""Calibration, selection and the whole core flow on a plain-PyTorch toy encoder."""
import copy
import math

import pytest
import torch

from latte_plugin.calibration.config import LatteConfig, num_linear_layers
from latte_plugin.nn.mha import LatteMultiheadAttention, swap_mha
from latte_plugin.calibration.record import LayerRecorder
from latte_plugin.calibration.taps import exact_taps
from latte_plugin.calibration.flow import calibrate_model
from latte_plugin.nn.install import find_latte_layers, set_modes
from latte_plugin.calibration.fit import fit_layer
from latte_plugin.calibration.select import naive_sensitivity_score, select_by_score
from latte_plugin.calibration.config import REFIT_REGS
from latte_plugin.ops.flops import exact_attention_flops, layer_flops, linear_attention_flops
from latte_plugin.calibration.select import SensitivityStats, backward_select, greedy_select
from tests.toy import ToyEncoder, toy_batches


def _record(model, batches, name, own_values=False):
    layer = find_latte_layers(model)[name]
    rec = LayerRecorder(name, max_items=64, max_queries=32, seed=0, own_values=own_values)
    with torch.no_grad(), exact_taps({name: layer}, {name: rec}):
        for b in batches:
            model(b)
    assert not layer.tapped
    return layer, rec


@pytest.mark.parametrize("variant", ["latte", "tte_only", "jpn_only", "qtvit"])
def test_fit_lowers_reconstruction_error_and_is_deterministic(variant):
    results = []
    for _ in range(2):
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"], variant)
        layer, rec = _record(model, toy_batches(), "layers.2.attn")
        layer.variant = variant
        res = fit_layer(layer, rec.items, steps=20)
        assert res.final_mse < res.initial_mse, (variant, res)
        results.append((layer.m.tolist(), layer.log_rho.tolist(), layer.sigma.clone(), res.final_mse))
    assert results[0][:2] == results[1][:2] and torch.equal(results[0][2], results[1][2])


def test_recorder_memory_is_bounded():
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.0.attn"])
    _, rec = _record(model, toy_batches(n=20, b=3), "layers.0.attn")
    assert rec.seen == 60 and len(rec.items) == 60
    rec2 = LayerRecorder("x", max_items=5, max_queries=7)
    layer = find_latte_layers(model)["layers.0.attn"]
    with torch.no_grad(), exact_taps({"x": layer}, {"x": rec2}):
        for b in toy_batches(n=20, b=3):
            model(b)
    assert rec2.seen == 60 and len(rec2.items) == 5 and all(it.q.shape[1] == 7 for it in rec2.items)


def test_recorder_rejects_nan_with_layer_name():
    rec = LayerRecorder("encoder.layers.3.self_attn")
    q = torch.zeros(1, 2, 4, 8)
    q[0, 0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="encoder.layers.3.self_attn"):
        rec(q, q, q, None, q)


def test_sensitivity_score_matches_hand_computation():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    at = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    # cos: row0 = 1/sqrt(2), row1 = 1; mean = (1/sqrt2 + 1)/2; mse = 1/4
    expect = (1 - (1 / math.sqrt(2) + 1) / 2) + 10 * (1.0 / 4)
    assert naive_sensitivity_score(a, at, lam=10) == pytest.approx(expect, rel=1e-7)
    st = SensitivityStats()
    st.update(a[None, :1], at[None, :1])
    st.update(a[None, 1:], at[None, 1:])
    assert st.score(10) == pytest.approx(expect, rel=1e-7)


def test_selection_by_ratio_and_count():
    assert num_linear_layers(6, ratio=0.67) == 4
    assert num_linear_layers(7, ratio=0.67) == 5
    assert num_linear_layers(6, ratio=0.83) == 5
    assert num_linear_layers(6, count=2) == 2
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="ratio"):
            num_linear_layers(6, ratio=bad)
    with pytest.raises(ValueError, match="num_linear=7"):
        num_linear_layers(6, count=7)
    assert select_by_score({"a": 0.3, "b": 0.1, "c": 0.2}, 2) == ["b", "c"]


def test_greedy_select_picks_least_harmful_first():
    cost = {"a": 3.0, "b": 1.0, "c": 2.0}
    chosen, trace = greedy_select(list(cost), 2, lambda s: sum(cost[n] for n in s))
    assert chosen == ["b", "c"] and [t["distortion"] for t in trace] == [1.0, 3.0]


def _flow(cfg, seed=0):
    model = ToyEncoder(seed=seed).eval()
    swap_mha(model, cfg.candidates, cfg.variant)
    rep = calibrate_model(model, toy_batches(), lambda b: model(b), cfg, log=lambda s: None)
    return model, rep


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("selection", ["score", "greedy"])
def test_flow_end_to_end(sequential, selection):
    cfg = LatteConfig(candidates=["layers.*.attn"], ratio=0.67, steps=15, sequential=sequential, selection=selection)
    model, rep = _flow(cfg)
    layers = find_latte_layers(model)
    assert rep["candidates"] == [f"layers.{i}.attn" for i in range(6)]
    assert len(rep["linearized"]) == 4 and set(rep["linearized"]) <= set(rep["candidates"])
    assert {n for n, l in layers.items() if l.mode == "linear"} == set(rep["linearized"])
    assert all(bool(l.calibrated) for l in layers.values())
    assert set(rep["params"]["layers.0.attn"]) == {"alpha", "delta_q", "delta_k", "beta_q", "beta_k"}
    assert rep["attention_gflops"]["linearized"] < rep["attention_gflops"]["exact"]
    if selection == "score":
        ranked = sorted(rep["sensitivity"], key=rep["sensitivity"].get)[:4]
        assert set(ranked) == set(rep["linearized"])
    # the same seed and data give the identical report
    _, rep2 = _flow(cfg)
    assert rep2 == rep


def test_hybrid_is_closer_to_exact_than_uncalibrated():
    cfg = LatteConfig(candidates=["layers.*.attn"], ratio=0.67, steps=20)
    model, rep = _flow(cfg)
    batches = toy_batches(seed=7)
    layers = find_latte_layers(model)
    with torch.no_grad():
        set_modes(layers, [])
        ref = [model(b) for b in batches]
        set_modes(layers, rep["linearized"])
        hyb = sum(float(((model(b) - r) ** 2).mean()) for b, r in zip(batches, ref))
        raw = copy.deepcopy(model)
        for l in find_latte_layers(raw).values():  # same layers, scalars at their defaults
            l.m.fill_(1.0), l.log_rho.fill_(0.0), l.sigma.fill_(1.0)
        unc = sum(float(((raw(b) - r) ** 2).mean()) for b, r in zip(batches, ref))
    assert hyb < unc


def test_flops_counts_and_ratio_at_1k():
    n, d, h = 1000, 32, 8
    assert exact_attention_flops(n, n, d, d, h) == h * (2 * n * n * d * 2 + 3 * n * n)
    ratio = layer_flops(n, n, d * h, h, False) / layer_flops(n, n, d * h, h, True)
    assert ratio > 15
    assert linear_attention_flops(2 * n, 2 * n, d, d, h) == pytest.approx(2 * linear_attention_flops(n, n, d, d, h), rel=0.01)


def test_exact_mode_is_bit_identical_to_torch_mha():
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=False)
    lat = LatteMultiheadAttention.from_torch(copy.deepcopy(mha))
    x = torch.randn(10, 3, 32)
    kpm = torch.zeros(3, 10, dtype=torch.bool)
    kpm[2, 6:] = True
    assert torch.equal(mha(x, x, x, key_padding_mask=kpm)[0], lat(x, x, x, key_padding_mask=kpm)[0])
    lat.latte.register_forward_hook(lambda *a: None)  # a tap: our own projection path, exact mode
    torch.testing.assert_close(lat(x, x, x, key_padding_mask=kpm)[0], mha(x, x, x, key_padding_mask=kpm)[0],
                               atol=1e-6, rtol=1e-6)


def test_modes_and_bad_settings():
    lat = LatteMultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 9, 16)
    exact = lat(x, x, x)[0]
    lat.latte.mode = "dynamic"
    lat.latte.threshold.fill_(10)  # 9 keys < 10: softmax
    torch.testing.assert_close(lat(x, x, x)[0], exact, atol=1e-6, rtol=1e-6)
    lat.latte.threshold.fill_(5)
    assert not torch.allclose(lat(x, x, x)[0], exact, atol=1e-4)
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)
    out = lat(x, x, x, attn_mask=causal)[0]  # honoured on the quadratic masked path
    x2 = x.clone()
    x2[:, -1] += 1.0
    torch.testing.assert_close(lat(x2, x2, x2, attn_mask=causal)[0][:, :-1], out[:, :-1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="additive attention bias"):
        lat(x, x, x, attn_mask=torch.randn(9, 9))
    with pytest.raises(ValueError, match="alpha must be"):
        lat.latte.set_alpha(1.5)
    with pytest.raises(ValueError, match="unknown attention mode"):
        lat.latte.mode = "fast"
    with pytest.raises(ValueError, match="matches no attention module"):
        swap_mha(ToyEncoder(), ["encoder.*"])
    with pytest.raises(ValueError, match="empty calibration set"):
        m = ToyEncoder()
        swap_mha(m, ["layers.*.attn"])
        calibrate_model(m, [], lambda b: m(b), LatteConfig(candidates=["layers.*.attn"]))
    with pytest.raises(ValueError, match="unknown LATTE setting"):
        LatteConfig.from_dict({"ratioo": 0.5})


def test_state_dict_round_trip_restores_hybrid(tmp_path):
    cfg = LatteConfig(candidates=["layers.*.attn"], ratio=0.5, steps=10)
    model, rep = _flow(cfg)
    path = tmp_path / "ckpt.pth"
    torch.save(model.state_dict(), path)
    fresh = ToyEncoder(seed=3)
    swap_mha(fresh, cfg.candidates)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    x = toy_batches(n=1)[0]
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), model(x))
    assert {n for n, l in find_latte_layers(fresh).items() if l.mode == "linear"} == set(rep["linearized"])


def test_per_head_fit_is_at_least_as_good_as_shared():
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    layer, rec = _record(model, toy_batches(), "layers.3.attn")
    shared = fit_layer(layer, rec.items, steps=15).final_mse
    assert len(set(layer.m.tolist())) == 1
    per_head = fit_layer(layer, rec.items, steps=15, per_head=True).final_mse
    assert per_head <= shared * (1 + 1e-9)
    # the heads really were fitted apart, and the report shows it
    assert len(set(layer.m.tolist())) > 1 or len(set(layer.log_rho.tolist())) > 1
    assert len(layer.scalars()["alpha_per_head"]) == layer.num_heads


def _three_roles():
    """Layer 2 of the toy encoder with recordings of 6 fit, 2 choice and 2 report batches."""
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    batches = toy_batches(n=10)
    layer, fit_rec = _record(model, batches[:6], "layers.2.attn")
    _, choose_rec = _record(model, batches[6:8], "layers.2.attn")
    _, report_rec = _record(model, batches[8:], "layers.2.attn")
    return layer, fit_rec, choose_rec, report_rec


def test_choice_items_pick_the_knobs_and_report_items_only_report():
    """Choice items pick the L-BFGS iterations; the refit strength is chosen by cross-fitting over
    the fit and choice items; the report items give each correction's error and change nothing."""
    layer, fit_rec, choose_rec, report_rec = _three_roles()

    sig = fit_layer(layer, fit_rec.items, steps=20, correction="sigma", choose=choose_rec.items,
                    report=report_rec.items)
    assert set(sig.choice["steps"]) == {0, 5, 10, 20} and sig.steps in sig.choice["steps"]
    assert min(sig.choice["steps"].values()) == pytest.approx(sig.choice["steps"][sig.steps])
    assert sig.heldout_mse == pytest.approx(sig.heldout["sigma"]) and set(sig.heldout) == {"none", "sigma", "refit"}
    assert not bool(layer.refit_on)

    ref = fit_layer(layer, fit_rec.items, steps=20, correction="refit", choose=choose_rec.items,
                    report=report_rec.items)
    cv = ref.choice["correction"]
    assert bool(layer.refit_on) and set(cv) == {f"refit@{r:g}" for r in REFIT_REGS}
    assert ref.correction == min(cv, key=cv.get) == f"refit@{ref.refit_reg:g}"
    assert ref.heldout_mse == pytest.approx(ref.heldout[ref.correction])
    assert ref.final_mse < sig.final_mse  # a full refit fits the fit set better than a diagonal
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    assert torch.isfinite(layer.linear(q, k, v)).all()

    alone = fit_layer(layer, fit_rec.items, steps=5, correction="refit")  # no choice items: cross-fitted all the same
    assert set(alone.choice["correction"]) == set(cv) and alone.refit_reg in REFIT_REGS
    big = fit_layer(layer, fit_rec.items, steps=5, correction="refit", refit_regs=(1e9,))
    torch.testing.assert_close(layer.refit_weight, torch.eye(32), atol=1e-4, rtol=0)
    assert big.refit_reg == 1e9
    none = fit_layer(layer, fit_rec.items, steps=5, correction="none")
    assert not bool(layer.refit_on) and torch.equal(layer.sigma, torch.ones(32)) and none.refit_reg is None
    with pytest.raises(ValueError, match="correction"):
        fit_layer(layer, fit_rec.items, correction="diagonal")


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if ".latte." in k}


def test_report_images_change_no_fitted_parameter_only_the_heldout_figures():
    """Held-out means held out: replacing the report images (global positions 7, 15, ...)
    leaves every fitted buffer bit-identical and changes the reported held-out figures."""
    cfg = dict(candidates=["layers.*.attn"], ratio=0.67, steps=5, holdout=0.25)
    batches = toy_batches(n=16)
    other = toy_batches(n=16, seed=99)
    changed = list(batches)
    report_positions = [i for i in range(16) if i % 4 == 3 and (i // 4) % 2 == 1]
    assert report_positions == [7, 15]
    for i in report_positions:
        changed[i] = other[i]
    runs = []
    for data in (batches, changed):
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"])
        rep = calibrate_model(model, data, lambda b: model(b), LatteConfig(**cfg), log=lambda s: None)
        runs.append((_state(model), rep))
    (s0, r0), (s1, r1) = runs
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert r0["linearized"] == r1["linearized"]
    assert r0["selection"]["images"] == {"fit": 12, "choose": 2, "report": 2}
    assert r0["selection"]["heldout_distortion"] != r1["selection"]["heldout_distortion"]
    for n in r0["fit"]:
        assert r0["fit"][n]["heldout_mse"] != r1["fit"][n]["heldout_mse"]
        assert r0["fit"][n]["choice"] == r1["fit"][n]["choice"]


@pytest.mark.parametrize("selection", ["greedy", "backward"])
def test_flow_reports_heldout_split_and_distortion(selection):
    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    rep = calibrate_model(model, toy_batches(n=8), lambda b: model(b),
                          LatteConfig(candidates=["layers.*.attn"], ratio=0.67, steps=5, selection=selection,
                                      correction="refit", holdout=0.25), log=lambda s: None)
    sel = rep["selection"]
    assert sel["method"] == selection and sel["images"] == {"fit": 6, "choose": 1, "report": 1}
    assert len(rep["linearized"]) == 4 and sel["heldout_distortion"] > 0
    for fit in rep["fit"].values():
        assert fit["refit_reg"] is not None and fit["heldout_mse"] is not None
    with pytest.raises(ValueError, match="holdout"):
        LatteConfig(holdout=1.0).validate()
    with pytest.raises(ValueError, match="correction="):
        LatteConfig.from_dict({"refit": False})


def test_backward_select_restores_the_most_harmful_layers():
    cost = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 0.5}
    chosen, trace = backward_select(list(cost), 2, lambda linear: sum(cost[n] for n in linear))
    assert sorted(chosen) == ["a", "d"]
    assert [t["restored"] for t in trace[1:]] == ["b", "c"]


def test_auto_correction_is_chosen_by_cross_fitting_per_layer():
    """correction='auto': every candidate (the paper's sigma, none, the refit at each strength)
    gets a cross-fitted error; the lowest is applied; the report images give every candidate's
    held-out error, the winner's included. 'none' fits nothing, so its cross-fitted error is
    exactly its plain error on the pool: a check that the folds add up."""
    from latte_plugin.calibration.corrections import correction_candidates, reconstruction_error

    layer, fit_rec, choose_rec, report_rec = _three_roles()
    res = fit_layer(layer, fit_rec.items, steps=5, correction="auto", choose=choose_rec.items,
                    report=report_rec.items)
    cv = res.choice["correction"]
    assert set(cv) == set(correction_candidates((1e-3, 1e-2, 1e-1, 1.0, 10.0))) == set(res.heldout)
    assert res.correction == min(cv, key=cv.get) and res.heldout_mse == res.heldout[res.correction]
    assert bool(layer.refit_on) == res.correction.startswith("refit")
    layer.refit_on.fill_(False)
    layer.sigma.fill_(1.0)
    pool = fit_rec.items + choose_rec.items
    assert cv["none"] == pytest.approx(reconstruction_error(layer, pool, use_sigma=False), rel=1e-6)  # fp32 vs fp64


def test_auto_selection_and_accuracy_target():
    """selection='auto' compares every (selection, correction rule) pair by cross-fitted error,
    each half of the images judging the sets the other half's searches found; target= makes as many layers linear as the budget
    allows: the chosen count is within it and every larger count is not."""
    def run(**kw):
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"])
        return calibrate_model(model, toy_batches(n=16), lambda b: model(b),
                               LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, **kw),
                               log=lambda s: None)

    rep = run(ratio=0.67)
    sel = rep["selection"]
    cmp = sel["comparison"]
    assert sel["method"] == "auto" and cmp["reference"] == "greedy+diag" and cmp["noise"] == "moderated"
    assert set(cmp["losses"]) == {f"{m}+{r}" for m in ("greedy", "score") for r in ("sigma", "refit", "auto", "diag")}
    assert cmp["losses"][cmp["best"]] == min(cmp["losses"].values())
    assert sel["configuration"] in (cmp["reference"], cmp["best"]) and sel["chosen"] == sel["configuration"].split("+")[0]
    # 16 images, none held out: two halves of 8, each searching on 2 (greedy_images // 2), every image judges
    assert (sel["halves"], sel["greedy_images"], sel["judge_images"], cmp["images"]) == ([8, 8], 4, 16, 16)
    assert sel["heldout"]["kind"] == "cross-fitted" and sel["heldout"]["images"] == 16
    assert sel["heldout"]["raw_mse"] == sel["heldout_distortion"] > 0 and sel["heldout"]["fidelity"] is None
    counts = []
    for target in (1e-9, 1e-2, 0.999):  # a budget is in (0, 1)
        rep = run(target=target)
        budget = rep["selection"]["target"]
        assert len(rep["linearized"]) == budget["k"] == rep["selection"]["k"]
        losses = budget["losses"]
        assert budget["k"] == 0 or min(losses[budget["k"]].values()) <= target  # within the budget
        assert all(min(losses[j].values()) > target for j in losses if j > budget["k"])  # no larger count is
        counts.append(budget["k"])
    assert counts[0] == 0 and counts[2] == 6 and counts[0] <= counts[1] <= counts[2]
    with pytest.raises(ValueError, match="target"):
        LatteConfig(target=0.0).validate()
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        LatteConfig(target=1.5).validate()


def test_each_folds_correction_is_chosen_and_fitted_without_that_fold():
    """fit_layer(fold_of=..., rules=...): for every rule and fold, the stored correction is the one
    cross-fitting over the *other* folds chooses, fitted from scratch on the other folds' items
    only (nested: no fold's correction was chosen or fitted with that fold in view)."""
    from latte_plugin.calibration.corrections import FoldSums, _normal_sums, assign_folds, correction_weights, cv_choice, rule_candidates
    from latte_plugin.calibration.record import stack_by_shape as _stack_by_shape, item_position

    layer, fit_rec, choose_rec, _ = _three_roles()
    for it in fit_rec.items + choose_rec.items:  # keys as the flow sets them: position * KEY_STRIDE
        it.key = it.key * 1024
    pool = fit_rec.items + choose_rec.items
    fold_of = assign_folds([item_position(it) for it in pool], 4)

    def sums(items):
        return _normal_sums(layer, _stack_by_shape(items), lambda t: t)

    res = fit_layer(layer, fit_rec.items, steps=3, correction="auto", choose=choose_rec.items, fold_of=fold_of,
                    rules=("sigma", "refit", "auto"))
    assert set(res.rules) == {"sigma", "refit", "auto"} and res.rules["auto"].name == res.correction
    parts = [[it for it in pool if fold_of[item_position(it)] == f] for f in range(4)]
    for rule, fitted in res.rules.items():
        cands = rule_candidates(rule, REFIT_REGS)
        assert len(fitted.folds) == 4
        for f, (kind, w) in enumerate(fitted.folds):
            others = [sums(p) for g, p in enumerate(parts) if g != f]
            name, _ = cv_choice(cands, FoldSums(others))
            rest = [it for g, p in enumerate(parts) if g != f for it in p]
            assert kind == cands[name][0], (rule, f)
            assert torch.allclose(w, correction_weights(kind, sums(rest), cands[name][1]), rtol=1e-6, atol=1e-8), (rule, f)
        assert not torch.allclose(fitted.folds[0][1], fitted.weights) or fitted.kind == "none"
    # the rules differ in what they may choose: sigma's is sigma, refit's is a refit
    assert res.rules["sigma"].kind == "sigma" and res.rules["refit"].kind == "refit"


def test_cross_fitted_runs_each_image_with_its_folds_correction():
    """cross_fitted applies fold f's weights while fold f's images run, and restores the full ones."""
    from latte_plugin.calibration.corrections import FittedCorrection
    from latte_plugin.calibration.judge import cross_fitted

    model = ToyEncoder().eval()
    swap_mha(model, ["layers.*.attn"])
    layers = find_latte_layers(model)
    c = next(iter(layers.values())).embed_dim
    corrections = {}
    for n in layers:
        full = torch.zeros(c + 1, c, dtype=torch.float64)
        full[:c].diagonal().fill_(9.0)
        per_fold = []
        for f in range(3):
            w = full.clone()
            w[:c].diagonal().fill_(float(f + 1))
            per_fold.append(("sigma", w))
        corrections[n] = FittedCorrection("sigma", "sigma", full, per_fold)
    first = next(iter(layers))
    seen = {}

    class Probe:
        name = "probe"

        def zeros(self):
            return torch.zeros(1, dtype=torch.float64)

        def run(self, pos):
            seen[pos] = float(layers[first].sigma[0])
            return None

        def sums(self, ref, out):
            return torch.ones(1, dtype=torch.float64)

        def loss(self, total):
            return float(total[0])

    batches = [(p, p) for p in range(7)]
    fold_of = {p: p % 3 for p in range(7)}
    verdict = cross_fitted(layers, corrections, batches, fold_of, Probe(), lambda t: t, refs=[None] * len(batches))(
        list(layers))
    assert verdict.loss == 7.0 and verdict.per_image.tolist() == [1.0] * 7  # the whole set's, and each image's
    assert seen == {p: float(p % 3 + 1) for p in range(7)}
    assert float(layers[first].sigma[0]) == 9.0  # restored


def test_error_compensation_refits_against_the_exact_model_and_is_kept_only_if_it_helps():
    """compensate=: each linear layer's correction is refitted in model order on inputs from the
    hybrid against the exact model's outputs. The first linear layer sees exact inputs, so its
    refit equals the plain fit; 'auto' keeps the compensation only when the cross-fitted output
    error is lower, and the layers then hold the kept corrections; 'never' does not run it."""
    def run(compensate):
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"])
        rep = calibrate_model(model, toy_batches(n=16), lambda b: model(b),
                              LatteConfig(candidates=["layers.*.attn"], steps=3, greedy_images=4, ratio=0.67,
                                          correction="refit", refit_reg=(0.01,), compensate=compensate),
                              log=lambda s: None)
        return model, rep

    _, never = run("never")
    assert "compensation" not in never["selection"]
    assert all("compensated" not in f for f in never["fit"].values())
    model, always = run("always")
    comp = always["selection"]["compensation"]
    assert comp["kept"] is True and set(comp["crossfit_distortion"]) == {"plain", "compensated"}
    first, *later = always["linearized"]
    assert always["fit"][first]["compensated"]["mse_final"] == pytest.approx(always["fit"][first]["mse_final"])
    assert any(always["fit"][n]["compensated"]["mse_final"] != pytest.approx(always["fit"][n]["mse_final"])
               for n in later)
    layers = find_latte_layers(model)
    assert all(bool(layers[n].refit_on) for n in always["linearized"])
    _, auto = run("auto")
    c = auto["selection"]["compensation"]
    assert c["kept"] == (c["crossfit_distortion"]["compensated"] < c["crossfit_distortion"]["plain"])
    with pytest.raises(ValueError, match="compensate"):
        LatteConfig(compensate="sometimes").validate()


def test_a_batch_of_more_than_key_stride_items_is_refused_not_collided():
    """Items are keyed ``position * KEY_STRIDE + index``: a larger batch would give two images
    one key; it is refused with the limit in the message."""
    from latte_plugin.calibration.record import KEY_STRIDE, LayerRecorder

    rec = LayerRecorder("layers.0.attn", max_items=4, max_queries=2)
    rec.batch_key = 3
    q = torch.zeros(KEY_STRIDE + 1, 1, 2, 4)
    with pytest.raises(ValueError, match=f"more than {KEY_STRIDE}"):
        rec(q, q, q, None, q)
    rec(q[:KEY_STRIDE], q[:KEY_STRIDE], q[:KEY_STRIDE], None, q[:KEY_STRIDE])
    assert len({it.key for it in rec.items}) == len(rec.items) == 4
