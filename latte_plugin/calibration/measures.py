"""How far a hybrid model's outputs are from the exact model's: the measures behind ``target=``.

A measure runs a batch (``run``), turns an exact and a hybrid result into a float64 vector of
sums (``sums``: summed across images and ranks) and the total into a loss (``loss``: 0 is
identical, lower is better): the :class:`~latte_plugin.calibration.context.Measure` protocol. Two measures:

* :class:`RawDistortion`: squared change of every raw output tensor, relative to their energy.
  Any model; what the generic entry uses.
* :class:`DetectionDisagreement`: ``1 -`` the agreement of the hybrid's detections with the
  exact model's (:func:`detection_agreement`). Raw head outputs of a detector are dominated by
  background queries, so a 1% raw distortion can hide a halved mAP (docs/results.md); this
  measure looks at what the evaluator looks at: confident boxes, their classes and overlaps.
* :class:`MatchedRawDistortion`: the raw-output MSE of a set-prediction detector (``(logits,
  boxes)`` per query slot) after matching each exact query to one hybrid query by box. DEIMv2-style
  decoders take their queries from the encoder's top scores, so a small change upstream reorders the
  slots and a slot-by-slot MSE compares different objects (docs/results.md#speed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

__all__ = ["RawDistortion", "MatchedRawDistortion", "match_queries", "naive_match_queries", "DetectionDisagreement",
           "Detections", "box_iou", "match_count", "naive_match_count", "detection_agreement", "IOU_THRESHOLDS",
           "SCORE_THRESHOLD"]

#: COCO's IoU thresholds 0.50:0.05:0.95.
IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
#: Detections at or above this score count (a common display threshold; below it, DETR-style
#: models put their many background queries).
SCORE_THRESHOLD = 0.3

#: One image's detections: ``(boxes (n, 4) xyxy, scores (n,), labels (n,))``.
Detections = tuple[Tensor, Tensor, Tensor]


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


class RawDistortion:
    """Squared change of the raw outputs: ``sums = [squared error, element count, exact energy]``.

    Args:
        forward: runs one batch; returns raw outputs (tensors, nested ok).
        relative: loss divided by the exact outputs' energy (else by the element count: an MSE).
    """

    name = "relative raw-output distortion"

    def __init__(self, forward: Callable[[Any], Any], relative: bool = True) -> None:
        self.run, self.relative = forward, relative
        if not relative:
            self.name = "raw-output MSE"

    def zeros(self) -> Tensor:
        return torch.zeros(3, dtype=torch.float64)

    def sums(self, ref: Any, out: Any) -> Tensor:
        ta = [t for t in _tensors(out) if t.is_floating_point()]
        tb = [t for t in _tensors(ref) if t.is_floating_point()]
        err = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(ta, tb))
        energy = sum(float((y.double() ** 2).sum()) for y in tb)
        return torch.tensor([err, float(sum(x.numel() for x in tb)), energy], dtype=torch.float64)

    def loss(self, total: Tensor) -> float:
        den = total[2] if self.relative else total[1]
        return float(total[0] / den) if float(den) > 0 else float("nan")


def match_queries(ref_boxes: Tensor, boxes: Tensor) -> Tensor:
    """The hybrid query matched to each exact query: the assignment of least total L1 box distance
    (Hungarian, ``scipy.optimize.linear_sum_assignment``).

    Args:
        ref_boxes: ``(Q, 4)`` the exact model's boxes; boxes: ``(Q, 4)`` the hybrid's.

    Returns:
        ``(Q,)`` int64: the hybrid query of each exact query.
    """
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(torch.cdist(ref_boxes.double(), boxes.double(), p=1).cpu().numpy())
    out = torch.empty(len(rows), dtype=torch.long)
    out[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
    return out


def naive_match_queries(ref_boxes: Tensor, boxes: Tensor) -> Tensor:
    """Reference for :func:`match_queries`: every permutation tried (a few queries only)."""
    import itertools

    cost = torch.cdist(ref_boxes.double(), boxes.double(), p=1)
    q = cost.shape[0]
    best = min(itertools.permutations(range(q)), key=lambda p: float(sum(cost[i, p[i]] for i in range(q))))
    return torch.tensor(best, dtype=torch.long)


class MatchedRawDistortion(RawDistortion):
    """The raw-output MSE of a set-prediction detector with its query slots matched by box.

    The forward returns ``(logits (B, Q, C), boxes (B, Q, 4))``; per image the hybrid's queries are
    put in the order :func:`match_queries` gives before the squared error is summed. Other outputs
    are compared slot by slot (:class:`RawDistortion`).
    """

    name = "raw-output MSE, queries matched by box"

    def __init__(self, forward: Callable[[Any], Any]) -> None:
        super().__init__(forward, relative=False)
        self.name = MatchedRawDistortion.name

    def sums(self, ref: Any, out: Any) -> Tensor:
        if not (isinstance(ref, (tuple, list)) and len(ref) == 2 and all(isinstance(t, Tensor) for t in ref)
                and ref[1].dim() == 3 and ref[1].shape[-1] == 4 and ref[0].shape[:2] == ref[1].shape[:2]):
            return super().sums(ref, out)
        br, (lo, bo) = ref[1], out
        order = torch.stack([match_queries(br[i], bo[i]) for i in range(br.shape[0])]).to(bo.device)  # (B, Q)
        return super().sums(ref, (_take_queries(lo, order), _take_queries(bo, order)))


def _take_queries(x: Tensor, order: Tensor) -> Tensor:
    """``x`` ``(B, Q, c)`` with its queries in ``order`` ``(B, Q)``."""
    return torch.gather(x, 1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of xyxy boxes ``a (n, 4)`` and ``b (m, 4)``: ``(n, m)``."""
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp_min(0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).clamp_min(0).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).clamp_min(0).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1e-12), torch.zeros_like(inter))


def _confident(dets: Detections, score_thr: float) -> Detections:
    boxes, scores, labels = dets
    keep = scores >= score_thr
    order = torch.argsort(scores[keep], descending=True, stable=True)
    return boxes[keep][order].double(), scores[keep][order], labels[keep][order]


def naive_match_count(ref: Detections, hyp: Detections, iou_thr: float, score_thr: float = SCORE_THRESHOLD) -> int:
    """Reference for :func:`match_count` at one threshold, in plain Python: COCO's greedy matching
    (hypotheses by descending score, each to the unmatched reference box of the same label with
    the highest IoU, if that IoU reaches ``iou_thr``)."""
    rb, _, rl = _confident(ref, score_thr)
    hb, _, hl = _confident(hyp, score_thr)
    used, count = set(), 0
    for i in range(len(hb)):
        best, best_iou = None, iou_thr
        for j in range(len(rb)):
            if j in used or int(rl[j]) != int(hl[i]):
                continue
            iou = float(box_iou(hb[i:i + 1], rb[j:j + 1])[0, 0])
            if iou >= best_iou and (best is None or iou > best_iou):
                best, best_iou = j, iou
        if best is not None:
            used.add(best)
            count += 1
    return count


def match_count(ref: Detections, hyp: Detections, iou_thrs: Sequence[float] = IOU_THRESHOLDS,
                score_thr: float = SCORE_THRESHOLD) -> Tensor:
    """Matched pairs of confident hypotheses and references at each IoU threshold: ``(T,)``.

    One IoU matrix for all thresholds; the greedy pass runs per threshold on it (the confident
    detections of one image are few).
    """
    rb, _, rl = _confident(ref, score_thr)
    hb, _, hl = _confident(hyp, score_thr)
    iou = box_iou(hb, rb)
    iou = torch.where(hl[:, None] == rl[None, :], iou, torch.full_like(iou, -1.0))
    counts = torch.zeros(len(iou_thrs), dtype=torch.float64)
    for t, thr in enumerate(iou_thrs):
        free = torch.ones(len(rb), dtype=torch.bool)
        for i in range(len(hb)):
            cand = torch.where(free, iou[i], torch.full_like(iou[i], -1.0))
            if len(cand) and float(cand.max()) >= thr:
                free[int(cand.argmax())] = False
                counts[t] += 1
    return counts


def detection_agreement(total: Tensor) -> float:
    """Agreement from summed ``[matches per IoU threshold..., references, hypotheses]``: the mean
    over thresholds of the F1 score ``2 matches / (references + hypotheses)``; 1 when neither
    model detects anything."""
    den = float(total[-2] + total[-1])
    return 1.0 if den == 0 else float((2 * total[:-2] / den).mean())


@dataclass
class DetectionDisagreement:
    """``1 - detection_agreement``: how many of the exact model's confident detections the hybrid
    loses or moves, and how many it adds (0: the same boxes, classes and confident set).

    Args:
        detect: runs one batch through the detector's own post-processing; one
            :data:`Detections` per image.
        score_thr: confidence at which a detection counts.
    """

    detect: Callable[[Any], list]
    score_thr: float = SCORE_THRESHOLD
    name: str = "detection disagreement (1 - F1 over IoU 0.50:0.95)"

    def run(self, batch: Any) -> list:
        return [tuple(t.detach().cpu() for t in d) for d in self.detect(batch)]

    def zeros(self) -> Tensor:
        return torch.zeros(len(IOU_THRESHOLDS) + 2, dtype=torch.float64)

    def sums(self, ref: list, out: list) -> Tensor:
        acc = self.zeros()
        for r, h in zip(ref, out):
            acc[:-2] += match_count(r, h, IOU_THRESHOLDS, self.score_thr)
            acc[-2] += float((r[1] >= self.score_thr).sum())
            acc[-1] += float((h[1] >= self.score_thr).sum())
        return acc

    def loss(self, total: Tensor) -> float:
        return 1.0 - detection_agreement(total)
