"""The choice rule of whole configurations (issue 39): the evidence reference, the moderated
standard error, and compensation under the same noise rule.

* a constructed near-tie at 8 images keeps the reference;
* a constructed clear gain at 8 images, with one image against it, moves away from the
  reference under the moderated error, where the plain error of the earlier rule cannot;
* the moderated error against its plain-Python reference;
* which pair is the reference for each user setting;
* compensation is kept only on a clear gain (by any margin with ``reference='paper'``).
"""
import math

import pytest
import torch

from latte_plugin.calibration.config import EVIDENCE_REFERENCE, LatteConfig
from latte_plugin.calibration.context import CalibrationRun, CalibrationSplit, Host
from latte_plugin.calibration.flow import _compensation_gain
from latte_plugin.calibration.judge import Verdict
from latte_plugin.calibration.select import (NOISE_Z, choose_configuration, moderated_gains, naive_moderated_gains,
                                             paired_gain)

REF = "greedy+refit"


def _verdicts(per_image: dict) -> dict:
    return {n: Verdict(sum(v) / len(v), torch.tensor(v, dtype=torch.float64)) for n, v in per_image.items()}


def _with_log_gains(ref: list, gains: list) -> list:
    """Per-image losses whose log ratio to ``ref`` is ``gains`` (floor-free: losses well above it)."""
    return [r / math.exp(g) for r, g in zip(ref, gains)]


REF_LOSSES = [1.0, 3.0, 2.0, 5.0, 1.5, 4.0, 2.5, 3.5]


def test_a_near_tie_at_8_images_keeps_the_reference():
    g = torch.Generator().manual_seed(0)
    cands = {REF: REF_LOSSES}
    for name in ("greedy+sigma", "greedy+auto", "score+refit", "score+auto", "score+sigma"):
        noise = (torch.randn(8, generator=g, dtype=torch.float64) * 0.2 + 0.03).tolist()
        cands[name] = _with_log_gains(REF_LOSSES, noise)
    chosen, info = choose_configuration(_verdicts(cands), reference=REF, moderated=True)
    assert info["best"] != REF and 0 < info["gain"] < NOISE_Z * info["standard_error"]
    assert chosen == REF and info["noise"] == "moderated" and info["images"] == 8


def test_a_clear_gain_at_8_images_moves_away_where_the_plain_rule_cannot():
    # the best gains a factor 2.2 on six images and loses on one; the other candidates' per-image
    # differences to the reference are steady, so the shared noise level is lower than this
    # candidate's own sample variance says
    best = _with_log_gains(REF_LOSSES, [0.8] * 6 + [0.2, -1.2])
    steady = {n: _with_log_gains(REF_LOSSES, [0.05 + 0.1 * ((i * (k + 2)) % 3 - 1) for i in range(8)])
              for k, n in enumerate(("greedy+sigma", "score+refit", "score+sigma"))}
    verdicts = _verdicts({REF: REF_LOSSES, "greedy+auto": best, **steady})
    plain, plain_info = choose_configuration(verdicts, reference=REF)
    assert plain == REF and plain_info["best"] == "greedy+auto"
    assert plain_info["gain"] < NOISE_Z * plain_info["standard_error"]
    moved, info = choose_configuration(verdicts, reference=REF, moderated=True)
    assert moved == "greedy+auto" and info["gain"] > NOISE_Z * info["standard_error"]
    assert info["standard_error"] < plain_info["standard_error"]


def test_the_reference_wins_ties_and_a_missing_reference_is_refused():
    same = _verdicts({"greedy+sigma": REF_LOSSES, REF: REF_LOSSES})
    assert choose_configuration(same, reference=REF, moderated=True)[0] == REF
    with pytest.raises(ValueError, match="'backward\\+refit' is not among"):
        choose_configuration(same, reference="backward+refit")


@pytest.mark.parametrize("n, k", [(1, 2), (2, 3), (8, 5), (40, 1), (8, 0)])
def test_the_moderated_error_matches_its_naive_reference(n, k):
    g = torch.Generator().manual_seed(10 * n + k)
    ref = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    cands = {f"c{i}": torch.rand(n, generator=g, dtype=torch.float64) + 0.1 for i in range(k)}
    cands["same"] = ref.clone()  # identical to the reference: no noise evidence, left out of the pool
    fast = moderated_gains(ref, cands)
    naive = naive_moderated_gains(ref.tolist(), {c: v.tolist() for c, v in cands.items()})
    for c in cands:
        assert fast[c][0] == pytest.approx(naive[c][0], rel=1e-12, abs=1e-15)
        assert (math.isinf(fast[c][1]) and math.isinf(naive[c][1])) or fast[c][1] == pytest.approx(naive[c][1], rel=1e-12)
    if n >= 2 and k >= 1:  # shrunk halfway toward the pooled variance of the informative candidates
        pooled = sum(float(paired_gain(ref, v)[1]) ** 2 * n for c, v in cands.items() if c != "same") / k
        own = paired_gain(ref, cands["c0"])[1] ** 2 * n
        assert fast["c0"][1] == pytest.approx(math.sqrt((own + pooled) / 2 / n), rel=1e-9)
        assert fast["same"][1] == pytest.approx(math.sqrt(pooled / 2 / n), rel=1e-9)


def _run(**settings) -> CalibrationRun:
    cfg = LatteConfig(**settings)
    return CalibrationRun({}, cfg, CalibrationSplit(), {}, Host(lambda b: b), judge=None, fidelity=None)


@pytest.mark.parametrize("settings, reference", [
    ({}, "+".join(EVIDENCE_REFERENCE)),
    ({"correction": "sigma"}, "greedy+sigma"),
    ({"selection": "score"}, "score+diag"),
    ({"selection": "backward", "correction": "auto"}, "backward+diag"),
    ({"reference": "paper"}, "score+sigma"),
    ({"correction_rules": ("sigma", "refit", "auto")}, "greedy+refit"),  # the defaults before diag joined
    ({"correction_rules": ("sigma", "auto")}, "greedy+sigma"),
])
def test_the_reference_follows_the_settings(settings, reference):
    run = _run(**settings)
    assert run.reference == reference
    assert run.methods == (("score", "greedy", "backward") if settings.get("reference") == "paper"
                           else (settings["selection"],) if "selection" in settings else ("greedy", "score"))


def test_compensation_is_kept_only_on_a_clear_gain():
    plain = Verdict(2.0, torch.tensor(REF_LOSSES, dtype=torch.float64))
    slight = Verdict(1.9, torch.tensor(_with_log_gains(REF_LOSSES, [0.3, -0.2, 0.1, 0.2, -0.1, 0.15, 0.0, 0.05]),
                                       dtype=torch.float64))
    clear = Verdict(1.0, torch.tensor(_with_log_gains(REF_LOSSES, [0.7, 0.6, 0.8, 0.65, 0.7, 0.75, 0.6, 0.7]),
                                      dtype=torch.float64))
    evidence, paper = LatteConfig(), LatteConfig(reference="paper")
    assert not _compensation_gain(evidence, plain, slight)["clear"]
    assert _compensation_gain(evidence, plain, clear)["clear"]
    assert _compensation_gain(paper, plain, slight)["clear"]  # the earlier rule: any margin


@torch.no_grad()
def test_reference_paper_is_the_earlier_rule_end_to_end():
    """``reference='paper'`` (the sweep's ``earlier`` row): three selections by each correction rule,
    ``score+sigma`` as reference, the plain error; the default: two selections by each rule,
    ``greedy+refit``, the moderated error."""
    from latte_plugin.calibration.config import CORRECTION_RULES
    from latte_plugin.calibration.flow import calibrate_model
    from latte_plugin.nn.mha import swap_mha
    from tests.toy import ToyEncoder, toy_batches

    def comparison(**kw):
        model = ToyEncoder().eval()
        swap_mha(model, ["layers.*.attn"])
        rep = calibrate_model(model, toy_batches(n=8), lambda b: model(b),
                              LatteConfig(candidates=["layers.*.attn"], steps=2, greedy_images=4, signal=False, **kw),
                              log=lambda s: None)
        return rep["selection"]["comparison"]

    earlier = comparison(reference="paper")
    assert earlier["reference"] == "score+sigma" and earlier["noise"] == "plain"
    assert len(earlier["losses"]) == 3 * len(CORRECTION_RULES) == 12
    ours = comparison()
    assert ours["reference"] == "greedy+diag" and ours["noise"] == "moderated"
    assert len(ours["losses"]) == 2 * len(CORRECTION_RULES) == 8
    assert ours["images"] == 8
