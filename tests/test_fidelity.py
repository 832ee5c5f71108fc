"""The fidelity measures behind target=: box IoU and greedy matching against plain references,
and the detection agreement's meaning on hand-made cases."""
import pytest
import torch
import torchvision

from latte_plugin.calibration.measures import IOU_THRESHOLDS, DetectionDisagreement, RawDistortion, box_iou, detection_agreement, match_count, naive_match_count


def _random_dets(gen, n, labels=3, size=100.0):
    xy = torch.rand(n, 2, generator=gen) * size
    wh = torch.rand(n, 2, generator=gen) * size / 3 + 1
    scores = torch.rand(n, generator=gen)
    scores[: n // 3] = 0.5  # ties in score
    return torch.cat([xy, xy + wh], 1), scores, torch.randint(0, labels, (n,), generator=gen)


def _jitter(dets, gen, scale):
    boxes, scores, labels = dets
    return boxes + torch.randn(boxes.shape, generator=gen) * scale, scores.flip(0), labels


def test_box_iou_matches_torchvision():
    gen = torch.Generator().manual_seed(0)
    a, _, _ = _random_dets(gen, 7)
    b, _, _ = _random_dets(gen, 5)
    b[0] = a[0]  # identical pair: IoU 1
    assert torch.allclose(box_iou(a, b), torchvision.ops.box_iou(a, b), atol=1e-6)
    assert float(box_iou(a[:1], b[:1])) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(40))
def test_match_count_equals_the_plain_reference(seed):
    """Every threshold, random detections with equal scores, shared labels, near duplicates."""
    gen = torch.Generator().manual_seed(seed)
    ref = _random_dets(gen, int(torch.randint(0, 9, (1,), generator=gen)))
    hyp = _jitter(ref, gen, scale=float(torch.rand(1, generator=gen)) * 8)
    if seed % 4 == 0:  # extra and missing detections
        extra = _random_dets(gen, 3)
        hyp = tuple(torch.cat([h[1:], e]) for h, e in zip(hyp, extra))
    fast = match_count(ref, hyp)
    slow = [naive_match_count(ref, hyp, t) for t in IOU_THRESHOLDS]
    assert fast.tolist() == slow


def test_agreement_on_hand_made_cases():
    boxes = torch.tensor([[0.0, 0, 10, 10], [20, 20, 40, 40]])
    ref = (boxes, torch.tensor([0.9, 0.8]), torch.tensor([1, 2]))
    m = DetectionDisagreement(detect=lambda b: b)

    def loss(hyp, r=ref):
        return m.loss(m.sums([r], [hyp]))

    assert loss(ref) == 0.0  # the same detections
    assert loss((boxes, torch.tensor([0.4, 0.35]), torch.tensor([1, 2]))) == 0.0  # scores above 0.3 only matter
    assert loss((boxes, ref[1], torch.tensor([2, 1]))) == 1.0  # classes swapped: nothing agrees
    assert loss((boxes[:1], ref[1][:1], ref[2][:1])) == pytest.approx(1 - 2 / 3)  # one lost: F1 = 2*1/(2+1)
    low = (torch.cat([boxes, boxes + 50]), torch.tensor([0.9, 0.8, 0.1, 0.1]), torch.tensor([1, 2, 1, 1]))
    assert loss(low) == 0.0  # background-level extras do not count
    shifted = (boxes + torch.tensor([2.0, 0, 2, 0]), ref[1], ref[2])  # IoU 8/12 and 36/44
    ious = [8 / 12, 36 / 44]
    expected = sum(2 * sum(i >= t for i in ious) / 4 for t in IOU_THRESHOLDS) / len(IOU_THRESHOLDS)
    assert loss(shifted) == pytest.approx(1 - expected)
    empty = (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert detection_agreement(m.sums([empty], [empty])) == 1.0  # nothing to agree on
    assert loss(empty) == 1.0


def test_raw_distortion_relative_and_mse():
    ref = {"a": torch.ones(2, 3), "b": [torch.zeros(4), torch.arange(3)]}  # integer tensors are ignored
    out = {"a": torch.ones(2, 3) * 1.5, "b": [torch.ones(4), torch.arange(3)]}
    rel, mse = RawDistortion(lambda b: b), RawDistortion(lambda b: b, relative=False)
    s = rel.sums(ref, out)
    assert s.tolist() == [6 * 0.25 + 4.0, 10.0, 6.0]
    assert rel.loss(s) == pytest.approx(5.5 / 6) and mse.loss(s) == pytest.approx(0.55)


@pytest.mark.parametrize("queries,seed", [(3, 0), (5, 1), (6, 2)])
def test_query_matching_equals_trying_every_permutation(queries, seed):
    from latte_plugin.calibration.measures import match_queries, naive_match_queries

    gen = torch.Generator().manual_seed(seed)
    ref, boxes = torch.rand(queries, 4, generator=gen), torch.rand(queries, 4, generator=gen)
    assert torch.equal(match_queries(ref, boxes), naive_match_queries(ref, boxes))


def test_matched_raw_distortion_ignores_the_slot_order_and_sees_real_changes():
    """A detector's outputs with their query slots shuffled: the slot-by-slot MSE is large, the matched
    one zero; a real change (a moved box, a changed logit) counts under both, and equally once the
    slots are shuffled too. Outputs that are not (logits, boxes) are compared slot by slot."""
    from latte_plugin.calibration.measures import MatchedRawDistortion

    gen = torch.Generator().manual_seed(0)
    logits, boxes = torch.randn(2, 9, 4, generator=gen), torch.rand(2, 9, 4, generator=gen)
    perm = torch.stack([torch.randperm(9, generator=gen) for _ in range(2)])

    def shuffled(x):
        return torch.gather(x, 1, perm.unsqueeze(-1).expand(-1, -1, x.shape[-1]))

    raw, matched = RawDistortion(lambda b: b, relative=False), MatchedRawDistortion(lambda b: b)
    ref = (logits, boxes)
    assert raw.loss(raw.sums(ref, (shuffled(logits), shuffled(boxes)))) > 0.1
    assert matched.loss(matched.sums(ref, (shuffled(logits), shuffled(boxes)))) == 0.0
    changed_logits = logits.clone()
    changed_logits[0, 3] += 2.0
    plain = raw.loss(raw.sums(ref, (changed_logits, boxes)))
    assert plain == pytest.approx(4 * 4 / (2 * 9 * 4 * 2))  # 4 logits moved by 2, over every element
    assert matched.loss(matched.sums(ref, (shuffled(changed_logits), shuffled(boxes)))) == pytest.approx(plain)
    other = (torch.randn(2, 5, generator=gen),)
    assert matched.loss(matched.sums(other, (other[0] + 1,))) == raw.loss(raw.sums(other, (other[0] + 1,)))


def test_judge_matched_is_a_configuration_measure():
    from latte_plugin.calibration.config import LatteConfig
    from latte_plugin.calibration.judge import configuration_judge
    from latte_plugin.calibration.measures import MatchedRawDistortion

    measure = configuration_judge(LatteConfig(judge="matched"), lambda b: b, None)
    assert isinstance(measure, MatchedRawDistortion) and measure.name == "raw-output MSE, queries matched by box"
    with pytest.raises(ValueError, match="judge must be one of"):
        LatteConfig(judge="sorted")
