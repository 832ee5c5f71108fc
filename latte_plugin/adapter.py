"""The one adapter protocol: what a framework gives the calibration flow, and the one
function that runs it.

Every entry point (the mmdet hook and ``tools/calibrate.py``, the detectron2 hook and
meta-architectures, the generic :func:`latte_plugin.linearize`) calls :func:`calibrate` with
its own :class:`Adapter`. An adapter answers six questions and nothing else:

* ``unwrap``: the bare model inside the framework's wrappers (DDP, mmengine's);
* ``world`` and ``all_reduce_sum``: this rank, the number of ranks, and a sum across them;
* ``forward``: how one calibration batch runs (raw outputs, no post-processing);
* ``detect``: for detectors, how one batch runs through the framework's own post-processing
  (boxes, scores, labels per image), which ``target=`` budgets (``None`` for other models);
* ``batch_len`` and ``positions``: how many images a batch holds and, for samplers that do
  not deal round-robin, where each local batch sits globally;
* ``log`` and ``progress``: where lines and progress bars go.

So the options (``calibrate=auto|always|never``), the checks (empty set, a set smaller than
one batch) and the steps are the same in every framework.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from .console import progress as console_progress
from .core.fidelity import DetectionDisagreement
from .core.flow import LatteConfig, calibrate_model, match_candidates
from .core.mha import swap_mha

__all__ = ["Adapter", "TorchAdapter", "calibrate", "take_batches", "swap_attention", "default_forward",
           "format_layer_table"]


class Adapter:
    """One framework's side of calibration (defaults: plain PyTorch, ``torch.distributed``).

    Subclasses override what their framework does differently; :func:`calibrate` is the only caller.
    """

    #: Names the framework's train-split setting in the "empty calibration set" error.
    data_hint = "give at least one batch"

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The bare model inside DDP."""
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def world(self) -> tuple[int, int]:
        """``(rank, world_size)``."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` across ranks in place (identity on one rank)."""
        if self.world()[1] > 1:
            torch.distributed.all_reduce(t)
        return t

    def forward(self, model: nn.Module) -> Callable[[Any], Any]:
        """Runs one calibration batch on the bare model; returns its raw outputs."""
        return default_forward(model)

    def detect(self, model: nn.Module) -> Optional[Callable[[Any], list]]:
        """Runs one batch through the detector's post-processing: one ``(boxes (n, 4) xyxy,
        scores (n,), labels (n,))`` per image. ``None``: not a detector (``target=`` then budgets
        the relative raw-output distortion)."""
        return None

    def batch_len(self, batch: Any) -> int:
        """Images in one batch (the generic entry counts a batch as one item)."""
        return 1

    def positions(self, data: Any, batches: Sequence[Any]) -> Optional[list[int]]:
        """Global position of each local batch; ``None``: dealt round-robin across ranks."""
        return None

    def log(self, line: str) -> None:
        print(line)

    def progress(self, it: Iterable, total: int, desc: str) -> Iterator:
        return console_progress(it, total, desc)


class TorchAdapter(Adapter):
    """The generic entry's adapter: a user-given ``forward``, ``all_reduce`` and ``log``."""

    def __init__(self, forward: Optional[Callable[[Any], Any]] = None,
                 all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 log: Callable[[str], None] = print, progress: bool = True) -> None:
        self._forward, self._all_reduce, self._log, self._progress = forward, all_reduce, log, progress

    def forward(self, model: nn.Module) -> Callable[[Any], Any]:
        return self._forward or default_forward(model)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t) if self._all_reduce is not None else super().all_reduce_sum(t)

    def log(self, line: str) -> None:
        self._log(line)

    def progress(self, it: Iterable, total: int, desc: str) -> Iterator:
        return console_progress(it, total, desc) if self._progress else iter(it)


def take_batches(data: Iterable, num_images: int, world: int, batch_len: Callable[[Any], int],
                 hint: str = Adapter.data_hint) -> list:
    """This rank's share of ``num_images`` images as batches: an ``islice`` (train loaders may never end).

    Raises:
        ValueError: ``num_images`` smaller than one batch (a partial batch would calibrate on
            more images than asked), or no batch at all.
    """
    per_rank = math.ceil(num_images / world)
    batches, seen = [], 0
    for batch in itertools.islice(iter(data), per_rank):
        size = batch_len(batch)
        if not batches and num_images < size:
            raise ValueError(f"num_images={num_images} is smaller than the calibration batch size {size}; "
                             f"ask for at least {size} images or use smaller calibration batches")
        batches.append(batch)
        seen += size
        if seen >= per_rank:
            break
    if not batches:
        raise ValueError(f"empty calibration set: the calibration data yielded no images (asked for "
                         f"{num_images}); {hint}")
    return batches


@torch.no_grad()
def calibrate(adapter: Adapter, model: nn.Module, data: Iterable, cfg: LatteConfig) -> dict:
    """Installs LATTE in the candidates (idempotent), calibrates on ``data`` and selects; leaves the model hybrid.

    The caller decides *whether* to calibrate (``calibrate=`` and
    :func:`~latte_plugin.core.flow.needs_calibration`); this function always does.

    Args:
        adapter: the framework's :class:`Adapter`.
        model: the model, wrapped or not.
        data: this rank's calibration batches or loader (possibly endless).
        cfg: the LATTE settings.

    Returns:
        The core report (see :func:`latte_plugin.core.flow.calibrate_model`).
    """
    cfg.validate()
    bare = adapter.unwrap(model)
    swap_attention(bare, cfg.candidates, cfg.variant)
    rank, world = adapter.world()
    batches = take_batches(data, cfg.num_images, world, adapter.batch_len, adapter.data_hint)
    detect = adapter.detect(bare)
    report = calibrate_model(bare, batches, adapter.forward(bare), cfg, all_reduce=adapter.all_reduce_sum,
                             log=adapter.log, progress=adapter.progress, shard=(rank, world),
                             positions=adapter.positions(data, batches),
                             fidelity=DetectionDisagreement(detect) if detect is not None else None)
    adapter.log("[latte] per-layer calibration:\n" + format_layer_table(report))
    return report


def format_layer_table(report: dict) -> str:
    """A per-layer table of the calibration report, for the log."""
    rows = [f"{'layer':42s} {'sens.':>10s} {'alpha':>8s} {'delta':>9s} {'mse0':>10s} {'mse':>10s}  state"]
    for n in report["candidates"]:
        p, f = report["params"][n], report["fit"][n]
        state = "LINEAR" if n in report["linearized"] else "exact"
        rows.append(f"{n:42s} {report['sensitivity'][n]:10.4e} {p['alpha']:8.4f} {p['delta_q']:9.4g} "
                    f"{f['mse_initial']:10.3e} {f['mse_final']:10.3e}  {state}")
    return "\n".join(rows)


def _is_mha(mod: nn.Module) -> bool:
    return isinstance(mod, nn.MultiheadAttention) or isinstance(getattr(mod, "attn", None), nn.MultiheadAttention)


def swap_attention(model: nn.Module, patterns: Sequence[str], variant: str = "latte") -> list[str]:
    """Installs a LATTE core in every attention module named by ``patterns`` (idempotent).

    ``nn.MultiheadAttention`` modules are replaced by :class:`~latte_plugin.core.LatteMultiheadAttention`
    (same parameters); HF attention modules keep their class and get a ``latte`` child.
    In exact mode the model's outputs are unchanged.

    Returns:
        The matched module names, in model order.

    Raises:
        ValueError: a pattern matching nothing, or a matched module of an unsupported kind.
    """
    modules = dict(model.named_modules())
    names = match_candidates([n for n in modules if n], patterns)
    mha_names = [n for n in names if _is_mha(modules[n])]
    if mha_names:
        swap_mha(model, mha_names, variant)
    for name in (n for n in names if n not in mha_names):
        _install_hf(modules[name], name, variant)
    return names


def _install_hf(mod: nn.Module, name: str, variant: str) -> None:
    try:
        from .hf.attention import install_latte, is_hf_attention
    except ImportError:  # transformers missing
        is_hf_attention = None
    if is_hf_attention is None or not is_hf_attention(mod):
        raise ValueError(
            f"module {name!r} ({type(mod).__name__}) matched a candidate pattern but is neither an "
            "nn.MultiheadAttention (or a wrapper holding one as .attn) nor an HF transformers attention "
            "module; narrow the pattern to the attention modules themselves"
        )
    layer = install_latte(mod, variant)
    layer.variant = variant
    layer.layer_name = name


def default_forward(model: nn.Module) -> Callable[[Any], Any]:
    """Runs one calibration batch: ``model(**batch)`` for a dict, ``model(*batch)`` for a
    tuple/list, ``model(batch)`` otherwise. Tensors are moved to the model's device."""
    device = next(iter(model.parameters())).device

    def to(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def forward(batch: Any) -> Any:
        if isinstance(batch, dict):
            return model(**{k: to(v) for k, v in batch.items()})
        if isinstance(batch, (tuple, list)):
            return model(*[to(v) for v in batch])
        return model(to(batch))

    return forward

