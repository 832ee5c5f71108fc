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
* ``split`` and ``sample_positions``: a batch as single images and, for samplers that do
  not deal round-robin, where each local image sits in the global order;
* ``log`` and ``progress``: where lines and progress bars go.

So the options (``calibrate=auto|always|never``), the checks (an empty set) and the steps are
the same in every framework, and the calibration images are the same whatever the number of
processes (:func:`take_batches`).
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from .console import progress as console_progress, say
from .calibration.measures import DetectionDisagreement
from .calibration.config import LatteConfig
from .calibration.state import apply_inference_settings, needs_calibration
from .calibration.context import Host
from .calibration.flow import calibrate_model_ratios
from .nn.install import match_candidates, set_backend
from .nn.mha import swap_mha

__all__ = ["Adapter", "TorchAdapter", "calibrate", "calibrate_ratios", "ensure_calibrated", "take_batches", "swap_attention", "default_forward",
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

    def split(self, batch: Any) -> list:
        """One batch as single-image batches (the generic entry cannot split: a batch is one item)."""
        return [batch]

    def sample_positions(self, data: Any) -> Optional[Sequence[int]]:
        """The global sample position of each of this rank's samples, in the order ``data``
        yields them; ``None``: dealt round-robin across ranks (mmengine's ``DefaultSampler``,
        detectron2's ``TrainingSampler``, a generic per-rank list)."""
        return None

    def log(self, line: str) -> None:
        print(line)

    def notice(self, line: str) -> None:
        """A line the user must see even when the log goes to a file: logged, and said on the
        terminal (rank 0) when the log is not."""
        self.log(line)
        if self.log_is_quiet():
            say(line)

    def log_is_quiet(self) -> bool:
        """Whether :meth:`log` lines may not reach the terminal (a framework logger under ``quiet``)."""
        return False

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


_END = object()


def take_batches(data: Iterable, num_images: int, shard: tuple[int, int], adapter: "Adapter") -> tuple[list, list[int]]:
    """This rank's calibration images, one per batch, and their global sample positions.

    The calibration set is the images at global sample positions ``0 .. num_images - 1`` of
    the sampler's order (:meth:`Adapter.sample_positions`), so it is the same set whatever the
    number of processes and the loader's batch size. Batches are split into single images
    (:meth:`Adapter.split`) so that no image's padding depends on which images share its batch.
    Only as many batches are drawn as this rank needs (train loaders may never end).

    Returns:
        ``(batches, positions)``: possibly empty on one rank of several (e.g. detectron2's
        ``InferenceSampler`` gives each rank a contiguous block of the dataset).

    Raises:
        ValueError: no image at all in one process.
    """
    rank, world = shard
    given = adapter.sample_positions(data)
    if given is None:  # dealt round-robin: local sample i is global sample i * world + rank
        expected = len(range(rank, num_images, world))
        positions: Iterator[int] = itertools.count(rank, world)
    else:
        given = [int(p) for p in given]
        expected = sum(1 for p in given if p < num_images)
        positions = iter(given)
    batches, kept = [], []
    loader = iter(data) if expected else iter(())
    while len(kept) < expected:
        batch = next(loader, _END)
        if batch is _END:
            break
        for sample, pos in zip(adapter.split(batch), positions):
            if pos < num_images and len(kept) < expected:
                batches.append(sample)
                kept.append(pos)
    if not batches and world == 1:
        raise ValueError(f"empty calibration set: the calibration data yielded no images (asked for "
                         f"{num_images}); {adapter.data_hint}")
    return batches, kept


@torch.no_grad()
def calibrate(adapter: Adapter, model: nn.Module, data: Iterable, cfg: LatteConfig) -> dict:
    """Installs LATTE in the candidates (idempotent), calibrates on ``data`` and selects; leaves the model hybrid.

    The caller decides *whether* to calibrate (``calibrate=`` and
    :func:`~latte_plugin.calibration.state.needs_calibration`); this function always does.

    Args:
        adapter: the framework's :class:`Adapter`.
        model: the model, wrapped or not.
        data: this rank's calibration batches or loader (possibly endless).
        cfg: the LATTE settings.

    Returns:
        The core report (see :func:`latte_plugin.calibration.flow.calibrate_model`).
    """
    return next(calibrate_ratios(adapter, model, data, cfg, None))


def calibrate_ratios(adapter: Adapter, model: nn.Module, data: Iterable, cfg: LatteConfig,
                     ratios: Optional[Sequence[float]]) -> Iterator[dict]:
    """:func:`calibrate` for several linear shares in one calibration
    (:func:`~latte_plugin.calibration.flow.calibrate_model_ratios`): yields each share's report with the
    model left in that share's hybrid until the next is asked for. ``ratios=None``: ``cfg``'s own."""
    bare = adapter.unwrap(model)
    swap_attention(bare, cfg.candidates, cfg.variant, cfg.backend)
    rank, world = adapter.world()
    batches, positions = take_batches(data, cfg.num_images, (rank, world), adapter)
    total = int(adapter.all_reduce_sum(torch.tensor([float(len(batches))], dtype=torch.float64))[0])
    if total == 0:
        raise ValueError(f"empty calibration set: the calibration data yielded no images on any of the {world} "
                         f"processes (asked for {cfg.num_images}); {adapter.data_hint}")
    if total < cfg.num_images:  # said once, and the report records what was used
        adapter.notice(f"[latte] num_images={cfg.num_images}, but the calibration data holds {total}: calibrating on "
                       f"{total} (the report's config says num_images={total})")
        cfg = replace(cfg, num_images=total)
    detect = adapter.detect(bare)
    host = Host(adapter.forward(bare), adapter.all_reduce_sum, adapter.log, adapter.progress, (rank, world), positions,
                DetectionDisagreement(detect) if detect is not None else None)
    for report in calibrate_model_ratios(bare, batches, host, cfg, ratios):
        adapter.log("[latte] per-layer calibration:\n" + format_layer_table(report))
        yield report


def ensure_calibrated(adapter: Adapter, model: nn.Module, cfg: LatteConfig,
                      data: "Iterable | Callable[[], Iterable]") -> Optional[dict]:
    """The one calibrate-or-not decision every entry point takes when a model is built or loaded.

    Installs LATTE in the candidates (once: idempotent), then either calibrates (when
    :func:`~latte_plugin.calibration.state.needs_calibration` says so under ``cfg.calibrate``) or
    applies the inference-time settings (``mode``, ``threshold``) to the loaded calibration.

    Args:
        adapter: the framework's :class:`Adapter`. model: wrapped or not. cfg: the settings.
        data: the calibration data, or a function that builds it (only called when calibrating).

    Returns:
        The calibration report, or ``None`` when a loaded calibration was kept.
    """
    bare = adapter.unwrap(model)
    swap_attention(bare, cfg.candidates, cfg.variant, cfg.backend)
    if not needs_calibration(bare, cfg.calibrate):
        apply_inference_settings(bare, cfg, adapter.log)
        return None
    return calibrate(adapter, model, data() if callable(data) else data, cfg)


def format_layer_table(report: dict) -> str:
    """A per-layer table of the calibration report, for the log."""
    rows = [f"{'layer':42s} {'sens.':>10s} {'signal':>9s} {'alpha':>8s} {'delta':>9s} {'mse0':>10s} {'mse':>10s}  state"]
    signal = report.get("signal") or {}
    for n in report["candidates"]:
        p, f = report["params"][n], report["fit"][n]
        state = "LINEAR" if n in report["linearized"] else "exact"
        rows.append(f"{n:42s} {report['sensitivity'][n]:10.4e} {signal.get(n, float('nan')):9.2e} {p['alpha']:8.4f} "
                    f"{p['delta_q']:9.4g} {f['mse_initial']:10.3e} {f['mse_final']:10.3e}  {state}")
    return "\n".join(rows)


def _is_mha(mod: nn.Module) -> bool:
    return isinstance(mod, nn.MultiheadAttention) or isinstance(getattr(mod, "attn", None), nn.MultiheadAttention)


def swap_attention(model: nn.Module, patterns: Sequence[str], variant: str = "latte",
                   backend: Optional[str] = None) -> list[str]:
    """Installs a LATTE core in every attention module named by ``patterns`` (idempotent).

    ``nn.MultiheadAttention`` modules are replaced by :class:`~latte_plugin.nn.LatteMultiheadAttention`
    (same parameters); HF attention modules keep their class and get a ``latte`` child.
    In exact mode the model's outputs are unchanged. Every LATTE layer gets the kernel ``backend``
    (:data:`~latte_plugin.ops.BACKENDS`; ``None``: ``LATTE_KERNEL``, else ``auto``).

    ``patterns == ["auto"]``: the layers the model finds itself (``model.latte_candidates()``, the
    transformers detectors' global softmax attention; see :mod:`latte_plugin.hf.discovery`).

    Returns:
        The matched module names, in model order.

    Raises:
        ValueError: a pattern matching nothing, or a matched module of an unsupported kind.
    """
    modules = dict(model.named_modules())
    names = match_candidates([n for n in modules if n], resolve_candidates(model, patterns))
    mha_names = [n for n in names if _is_mha(modules[n])]
    if mha_names:
        swap_mha(model, mha_names, variant)
    for name in (n for n in names if n not in mha_names):
        _install_hf(modules[name], name, variant)
    set_backend(model, backend)  # resolved once, here: no forward reads the environment
    return names


AUTO = "auto"


def resolve_candidates(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """``patterns``, or for ``["auto"]`` the names ``model.latte_candidates()`` finds (cached on the model).

    Raises:
        ValueError: ``auto`` for a model that cannot find its own candidates.
    """
    if list(patterns) != [AUTO]:
        return list(patterns)
    found = getattr(model, "latte_candidates", None)
    if found is None:
        raise ValueError(f"candidates='auto' needs a model that finds its own attention layers (the transformers "
                         f"detector wrappers); {type(model).__name__} does not: name the attention modules by pattern")
    if getattr(model, "_latte_auto_names", None) is None:
        model._latte_auto_names = list(found())
        if not model._latte_auto_names:
            raise ValueError(f"candidates='auto': {type(model).__name__} has no global softmax attention layer to "
                             "linearize")
    return list(model._latte_auto_names)


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
    if not bool(layer.calibrated):  # a calibrated layer keeps its variant (its scalars belong to it)
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

