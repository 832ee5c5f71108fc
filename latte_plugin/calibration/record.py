"""Recording: what each candidate layer saw in the exact model, bounded and keyed to the images.

* :class:`LayerRecorder` keeps a bounded, seeded reservoir of one layer's inputs and exact outputs;
* :func:`share_items` gives every rank the same items (through the sum-only all-reduce);
* :func:`record_layers` runs every role's images once with recorders tapped on some layers
  (``docs/architecture.md#recording``): a one-layer recording of a layer seen to run once per
  forward stops each forward after it (:class:`RecordingDone`), which changes no record.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..nn.params import own_values
from ..ops.piecewise import pooled_queries
from .context import ROLES, AllReduce, CalibrationRun
from .taps import exact_taps

__all__ = ["RecordedItem", "KEY_STRIDE", "item_position", "image_generator", "RecordingDone", "LayerRecorder",
           "share_items", "stack_by_shape", "sum_count", "record_layers", "runs_once"]


@dataclass
class RecordedItem:
    """One image's view of one layer: the sampled queries, all valid keys and the softmax target.

    Shapes: q ``(H, n, d)``, k ``(H, M, d)``, v ``(H, M, d_v)``, target ``(H, n, d_v)``.
    Padded keys are dropped at record time. ``mask`` ``(1, n, M)`` (``True`` = masked pair)
    is kept only for layers with a general mask (e.g. causal text attention). ``key`` is the
    image's global key and ``priority`` its keyed random priority (lower = kept first).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    target: Tensor
    mask: Optional[Tensor] = None
    key: int = 0
    priority: float = 0.0
    #: ``(H, n, d)``: each sampled query's pooled query (the mean of its block of the image's
    #: queries), recorded for the piecewise kernel (``LayerRecorder.pool_block``); else ``None``
    q_pool: Optional[Tensor] = None
    #: ``(H, n, d_v)``: each sampled query's own value (self-attention: as many queries as keys),
    #: for the diagonal term of ``correction='diag'``; else ``None``
    v_own: Optional[Tensor] = None


#: An item's key is ``batch position * KEY_STRIDE + index in the batch``.
KEY_STRIDE = 1024


def item_position(item: RecordedItem) -> int:
    """The global batch position an item was recorded at (see :class:`LayerRecorder`)."""
    return int(item.key) // KEY_STRIDE


def image_generator(seed: int, key: int) -> torch.Generator:
    """The sampling generator of one image: a function of ``(seed, key)`` only, so an image
    is sampled the same way whichever rank, batch or order it arrives in."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(key) * 7919 + 17) % (2**63 - 1))


class RecordingDone(Exception):
    """Raised by a :class:`LayerRecorder` with ``stop_after`` once it has its batch: the caller
    of the forward catches it and skips the rest of the model."""


@dataclass
class LayerRecorder:
    """Bounded record of a layer's inputs and exact outputs.

    Memory stays bounded whatever the number of images: at most ``max_items`` images are
    kept (those with the lowest keyed priority) and at most ``max_queries`` query tokens of
    each. All keys of a kept image are stored, because linear attention sums over them.
    Sampling is keyed to each image's global key (``batch_key``, set by the flow before
    each forward), not to arrival order, so one process and several record the same
    items (:func:`share_items` then applies ``max_items`` across ranks and gives every rank all items).

    Args:
        name: the layer's module name, for error messages.
        max_items: images kept per layer.
        max_queries: query tokens kept per image.
        seed: the seed of the sampling.
    """

    name: str
    max_items: int = 64
    max_queries: int = 128  # LatteConfig.max_queries
    seed: int = 0
    items: list[RecordedItem] = field(default_factory=list)
    seen: int = 0
    #: global position of the batch about to run (set by the flow); ``None``: arrival order.
    batch_key: Optional[int] = None
    #: raise :class:`RecordingDone` once the batch is recorded (the flow sets it for a layer
    #: known to run once per forward: the rest of the forward cannot change this record)
    stop_after: bool = False
    #: > 0: also record each sampled query's pooled query over blocks of this many queries
    #: (:attr:`RecordedItem.q_pool`, for the piecewise kernel)
    pool_block: int = 0
    pool_order: str = "tokens"
    #: also record each sampled query's own value where the layer is self-attention
    #: (:attr:`RecordedItem.v_own`, for ``correction='diag'``)
    own_values: bool = False
    calls: int = 0
    #: called again within one forward (the same ``batch_key``): such a layer cannot stop early
    repeated: bool = False
    _last_key: Optional[int] = field(default=None, repr=False)

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], out: Tensor,
        attn_mask: Optional[Tensor] = None,
    ) -> None:
        """Records a batch: q ``(B, H, N, d)``, k/v ``(B, H, M, .)``, out ``(B, H, N, d_v)``;
        ``attn_mask`` bool ``(B|1, 1, N, M)`` (``True`` = masked), the same for every head."""
        if attn_mask is not None and attn_mask.shape[1] != 1 and not bool((attn_mask == attn_mask[:, :1]).all()):
            raise ValueError(f"layer '{self.name}': per-head attention masks are not supported by LATTE calibration")
        for name, t in (("q", q), ("k", k), ("v", v), ("output", out)):
            if not bool(torch.isfinite(t).all()):
                raise FloatingPointError(
                    f"non-finite values (NaN/Inf) in the recorded {name} of layer '{self.name}'; "
                    "check the input images and the checkpoint"
                )
        self.repeated |= self.calls > 0 and self.batch_key is not None and self.batch_key == self._last_key
        self.calls, self._last_key = self.calls + 1, self.batch_key
        if self.batch_key is not None and q.shape[0] > KEY_STRIDE:
            raise ValueError(f"layer '{self.name}': a calibration batch of {q.shape[0]} items, more than "
                             f"{KEY_STRIDE} (items are keyed batch position * {KEY_STRIDE} + index); "
                             f"give batches of at most {KEY_STRIDE} items")
        for b in range(q.shape[0]):
            # image b of batch p is image key p * KEY_STRIDE + b: global, whatever the rank or order
            key = self.seen if self.batch_key is None else int(self.batch_key) * KEY_STRIDE + b
            self.seen += 1
            self._add(self._item(q, k, v, key_padding_mask, out, attn_mask, b, key))
        if self.stop_after:
            raise RecordingDone(self.name)

    def _item(self, q, k, v, key_padding_mask, out, attn_mask, b: int, key: int) -> RecordedItem:
        gen = image_generator(self.seed, key)
        priority = float(torch.rand(1, generator=gen, dtype=torch.float64))
        n = q.shape[2]
        idx = torch.randperm(n, generator=gen)[: self.max_queries].sort().values if n > self.max_queries \
            else torch.arange(n)
        kb, vb, mask = k[b], v[b], None
        v_own = None
        if self.own_values and own_values(q, v) is not None:
            v_own = v[b][:, idx.to(q.device)].detach().float().cpu()
        if attn_mask is not None:
            mask = attn_mask[b if attn_mask.shape[0] > 1 else 0, :1].expand(1, n, k.shape[2])[:, idx.to(q.device)]
        if key_padding_mask is not None:
            keep = ~key_padding_mask[b]
            kb, vb = kb[:, keep], vb[:, keep]
            mask = None if mask is None else mask[:, :, keep]
        q_pool = None
        if self.pool_block > 0 and mask is None:
            pool = pooled_queries(q[b:b + 1], self.pool_block, self.pool_order)[0]
            q_pool = pool[:, idx.to(q.device)].detach().float().cpu()
        return RecordedItem(q=q[b][:, idx].detach().float().cpu(), k=kb.detach().float().cpu(),
                            v=vb.detach().float().cpu(), target=out[b][:, idx].detach().float().cpu(),
                            mask=None if mask is None else mask.detach().cpu(), key=key, priority=priority,
                            q_pool=q_pool, v_own=v_own)

    def _add(self, item: RecordedItem) -> None:
        self.items.append(item)
        if len(self.items) > self.max_items:  # drop the highest priority: keeps the lowest max_items
            worst = max(range(len(self.items)), key=lambda i: (self.items[i].priority, self.items[i].key))
            self.items.pop(worst)


_HEADER = ("present", "key", "priority", "H", "n", "M", "d", "dv", "has_mask", "has_pool", "has_own")


def _item_sizes(row: list[float]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of an item described by a header row, with their shapes."""
    h, n, m, d, dv = (int(row[i]) for i in range(3, 8))
    parts = [("q", (h, n, d)), ("k", (h, m, d)), ("v", (h, m, dv)), ("target", (h, n, dv))]
    return (parts + ([("mask", (1, n, m))] if row[8] else []) + ([("q_pool", (h, n, d))] if row[9] else [])
            + ([("v_own", (h, n, dv))] if row[10] else []))


def _all_gather_items(items: list[RecordedItem], slots: int, all_reduce: AllReduce,
                      shard: tuple[int, int]) -> list[RecordedItem]:
    """Every rank's items on every rank, through the sum-only ``all_reduce``: a header table
    (one row per rank and slot, zero where empty), then one flat buffer where each rank fills
    only its own ranges. Adding zeros is exact, so every rank gets the items bit for bit."""
    rank, world = shard
    header = torch.zeros(world, slots, len(_HEADER), dtype=torch.float64)
    for i, it in enumerate(items):
        (h, n, d), m, dv = it.q.shape, it.k.shape[1], it.v.shape[-1]
        header[rank, i] = torch.tensor([1.0, it.key, it.priority, h, n, m, d, dv, float(it.mask is not None),
                                        float(it.q_pool is not None), float(it.v_own is not None)],
                                       dtype=torch.float64)
    rows = [r for r in all_reduce(header).view(-1, len(_HEADER)).tolist() if r[0] > 0]
    sizes = [sum(math.prod(shape) for _, shape in _item_sizes(r)) for r in rows]
    offsets = [0] + list(itertools.accumulate(sizes))
    flat = torch.zeros(offsets[-1], dtype=torch.float32)
    first = sum(1 for r in header[:rank].view(-1, len(_HEADER)).tolist() if r[0] > 0)
    for j, it in enumerate(items):
        parts = [getattr(it, f).reshape(-1).float() for f, _ in _item_sizes(rows[first + j])]
        flat[offsets[first + j]:offsets[first + j + 1]] = torch.cat(parts)
    flat = all_reduce(flat)
    out = []
    for r, start in zip(rows, offsets):
        fields, pos = {}, start
        for f, shape in _item_sizes(r):
            fields[f] = flat[pos:pos + math.prod(shape)].view(shape).clone()
            pos += math.prod(shape)
        mask = fields.pop("mask", None)
        out.append(RecordedItem(**fields, mask=None if mask is None else mask.bool(), key=int(r[1]), priority=r[2]))
    return out


def share_items(recorder: LayerRecorder, all_reduce: AllReduce, shard: tuple[int, int]) -> None:
    """Gives every rank the same items in the same order: the ``max_items`` of lowest keyed
    priority across all ranks, sorted by key.

    Every rank then fits on identical data in an identical order, so the fitted scalars and
    corrections equal one process's exactly (sums split across ranks would differ in the last
    bits, which L-BFGS amplifies along the flat directions of the loss). In one process
    this only sorts.
    """
    items = recorder.items
    if shard[1] > 1:
        items = _all_gather_items(items, recorder.max_items, all_reduce, shard)
    items = sorted(items, key=lambda it: (it.priority, it.key))[: recorder.max_items]
    recorder.items = sorted(items, key=lambda it: it.key)


def sum_count(values: list[tuple[Tensor, float]], all_reduce: AllReduce) -> Tensor:
    acc = torch.zeros(2, dtype=torch.float64)
    for s, c in values:
        acc[0] += float(s)
        acc[1] += c
    return all_reduce(acc)


def stack_by_shape(items: list[RecordedItem]) -> list[RecordedItem]:
    """Same-shaped items stacked along a new leading dim: ``(G, H, n, d)``, in float64.

    float64 makes the fit independent of how images are split across ranks (the loss is
    flat along some directions, where float32 summation order would show).

    Fitting then runs one batched op per shape instead of one per image. Groups are kept
    in first-seen order, so the result is deterministic.
    """
    groups: dict[tuple, list[RecordedItem]] = {}
    for it in items:
        key = (tuple(it.q.shape), tuple(it.k.shape), it.mask is None, it.q_pool is None, it.v_own is None)
        groups.setdefault(key, []).append(it)
    return [
        RecordedItem(
            *(torch.stack([getattr(it, f) for it in g]).double() for f in ("q", "k", "v", "target")),
            mask=None if g[0].mask is None else torch.stack([it.mask for it in g]),
            q_pool=None if g[0].q_pool is None else torch.stack([it.q_pool for it in g]).double(),
            v_own=None if g[0].v_own is None else torch.stack([it.v_own for it in g]).double(),
        )
        for g in groups.values()
    ]


def record_layers(run: CalibrationRun, group: list[str], desc: str) -> dict[str, dict[str, LayerRecorder]]:
    """Runs every role's batches once with recorders on ``group``: ``{role: {layer: recorder}}``.

    Each image is keyed by its global position, so sampling and the ``max_items`` budget
    (applied across ranks) do not depend on the number of processes. A recording run to the
    end adds the layers that ran once per forward to ``run.caches.runs_once``; a one-layer recording
    of such a layer stops each forward after it.
    """
    cfg, layers = run.cfg, run.layers
    pool = cfg.piecewise_block if cfg.kernel != "latte" or cfg.for_speed else 0
    recs = {role: {n: LayerRecorder(n, cfg.max_items, cfg.max_queries, cfg.seed, pool_block=pool,
                                    pool_order=cfg.piecewise_order, own_values="diag" in run.rules) for n in group}
            for role in ROLES}
    stop = len(group) == 1 and group[0] in run.caches.runs_once
    forwards = 0
    for role in ROLES:
        part = getattr(run.split, role)
        for n in group:
            recs[role][n].stop_after = stop
        label = desc if role == "fit" else f"{desc} ({role} images)"
        with exact_taps(layers, recs[role]):
            for pos, batch in run.progress(part, len(part), label):
                for n in group:
                    recs[role][n].batch_key = pos
                try:
                    run.forward(batch)
                except RecordingDone:  # the layer has its batch; the rest of the model is not needed
                    pass
        forwards += len(part)
    for role in ROLES:
        for rec in recs[role].values():
            share_items(rec, run.reduce, run.shard)
    if not stop:  # how often a layer runs per forward does not depend on the modes: any full recording tells
        run.caches.runs_once |= runs_once(recs, forwards, run.reduce)
    return recs


def runs_once(recs: dict[str, dict[str, LayerRecorder]], forwards: int, all_reduce: AllReduce) -> set[str]:
    """The layers whose recorders were called exactly once in each of ``forwards`` forwards
    (this rank's), on every rank: those a one-layer recording may stop after."""
    names = list(recs[ROLES[0]])
    bad = torch.tensor([float(sum(recs[r][n].calls for r in ROLES) != forwards or any(recs[r][n].repeated for r in ROLES))
                        for n in names], dtype=torch.float64)
    bad = all_reduce(bad)
    return {n for n, b in zip(names, bad.tolist()) if b == 0}
