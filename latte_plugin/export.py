"""ONNX export of a calibrated hybrid, and the onnxruntime check against the torch model.

A calibrated LATTE layer is matmuls, squares, norms and sums, so the hybrid exports with
standard ONNX operators only (no custom ops; opset 17 or newer). What is exported is the
model *as it runs at inference*: linear layers linear, the rest exact (softmax).

Dynamic mode (softmax below ``threshold`` keys) is not exported as an ONNX ``If``: those
layers export their **linear** path, with a warning, since the threshold targets large inputs.
The exporter is torch's TorchScript-based ``torch.onnx.export(dynamo=False)``: it needs no
extra package and keeps the spatial size dynamic where the model's code allows it.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn
from .nn.install import find_latte_layers

__all__ = ["export_onnx", "onnx_ops", "run_onnx", "max_abs_diff", "query_matched_diff", "STANDARD_DOMAINS"]

#: Operator domains of standard ONNX (the empty string is ``ai.onnx``).
STANDARD_DOMAINS = ("", "ai.onnx")


@contextlib.contextmanager
def inference_modes(model: nn.Module) -> Iterator[list[str]]:
    """Dynamic-mode LATTE layers run linear for the export (warned); restored afterwards. A
    piecewise layer with the ``lowrank`` order is refused (no ONNX eigendecomposition).

    Yields:
        The names of the layers that were switched.
    """
    layers = find_latte_layers(model)
    lowrank = [n for n, layer in layers.items()
               if layer.mode in ("linear", "dynamic") and layer.kernel == "piecewise" and layer.piecewise_order == "lowrank"]
    if lowrank:  # before tracing: the eigendecomposition would fail deep inside the exporter
        raise ValueError(f"piecewise layer {lowrank[0]} uses piecewise_order='lowrank', which has no ONNX graph (an "
                         f"eigendecomposition){f' (and {len(lowrank) - 1} more)' if len(lowrank) > 1 else ''}; "
                         "calibrate with piecewise_order='similarity' to export")
    dynamic = [n for n, layer in layers.items() if layer.mode == "dynamic"]
    if dynamic:
        warnings.warn(f"dynamic-mode LATTE layers {dynamic} are exported on their linear path (no ONNX If); "
                      "set them to 'linear' or 'exact' to choose explicitly", stacklevel=3)
    for n in dynamic:
        layers[n].mode = "linear"
    try:
        yield dynamic
    finally:
        for n in dynamic:
            layers[n].mode = "dynamic"


def onnx_ops(path: str) -> set[tuple[str, str]]:
    """``{(domain, op_type)}`` of every node in the graph, subgraphs included."""
    import onnx

    ops: set[tuple[str, str]] = set()

    def walk(graph) -> None:
        for node in graph.node:
            ops.add((node.domain, node.op_type))
            for attr in node.attribute:
                if attr.g is not None and len(attr.g.node):
                    walk(attr.g)

    walk(onnx.load(path).graph)
    return ops


@torch.no_grad()
def export_onnx(model: nn.Module, example_inputs: Any, path: str, input_names: Sequence[str] = ("input",),
                output_names: Optional[Sequence[str]] = None, dynamic_axes: Optional[dict] = None,
                opset: int = 17) -> str:
    """Exports ``model`` (eval mode, as it runs at inference) to ``path`` with standard ONNX ops.

    Args:
        model: any module; LATTE layers export in their current mode (dynamic -> linear, warned).
        example_inputs: a tensor or a tuple of tensors, positional arguments of ``model``.
        path: the ``.onnx`` file, written atomically.
        input_names, output_names: graph names. dynamic_axes: as ``torch.onnx.export``
            (e.g. ``{"input": {0: "batch", 2: "height", 3: "width"}}``).
        opset: ONNX opset, 17 or newer.

    Returns:
        ``path``.

    Raises:
        ValueError: opset below 17, or the graph uses an operator outside standard ONNX.
    """
    if opset < 17:
        raise ValueError(f"opset {opset} is too old: LATTE exports need opset 17 or newer (LayerNormalization)")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    was_training = model.training
    model.eval()
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".onnx", dir=out_dir)
    os.close(fd)
    try:
        with inference_modes(model), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            torch.onnx.export(model, args, tmp, input_names=list(input_names),
                              output_names=list(output_names) if output_names else None,
                              dynamic_axes=dynamic_axes, opset_version=opset, do_constant_folding=True,
                              dynamo=False)
        custom = sorted(f"{d}::{op}" for d, op in onnx_ops(tmp) if d not in STANDARD_DOMAINS)
        if custom:
            raise ValueError(f"{path}: the exported graph uses non-standard operators {custom}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        model.train(was_training)
    return path


def run_onnx(path: str, *inputs: torch.Tensor, session: Any = None) -> list[torch.Tensor]:
    """Runs the graph in onnxruntime on CPU; returns its outputs as tensors."""
    if session is None:
        session = session_for(path)
    feeds = {i.name: x.detach().cpu().numpy() for i, x in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


def session_for(path: str, threads: Optional[int] = None) -> Any:
    """An onnxruntime CPU ``InferenceSession`` for ``path``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference over paired outputs."""
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def query_matched_diff(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> tuple[float, bool]:
    """The largest difference between per-query outputs once queries are matched, and whether
    their order differed.

    RT-DETR picks its queries with a top-k over encoder scores; where two scores nearly tie,
    onnxruntime and torch may list the same two queries in the other order. The detections do
    not depend on the order (post-processing is a top-k over queries x classes), so outputs are
    compared per query: each torch query to its nearest onnxruntime query (max norm over the
    concatenated outputs), which must form a permutation.

    Args:
        ref, got: outputs of shape ``(B, Q, *)`` each (e.g. logits and boxes).

    Returns:
        ``(difference, reordered)``; ``difference`` is ``inf`` if the matching is not a permutation.
    """
    a = torch.cat([r.float().flatten(2) for r in ref], dim=-1)  # (B, Q, F)
    b = torch.cat([g.float().flatten(2) for g in got], dim=-1)
    worst, reordered = 0.0, False
    for x, y in zip(a, b):
        dist = torch.cdist(x[None], y[None], p=float("inf"))[0]  # (Q, Q)
        best, match = dist.min(dim=1)
        if len(set(match.tolist())) != len(match):  # near-duplicate queries: a one-to-one assignment
            match = _assignment(dist)
            if match is None:
                return float("inf"), True
            best = dist[torch.arange(len(match)), match]
        reordered |= bool((match != torch.arange(len(match))).any())
        worst = max(worst, float(best.max()))
    return worst, reordered


def _assignment(dist: torch.Tensor) -> Optional[torch.Tensor]:
    """The one-to-one query matching of least total distance (scipy's Hungarian solver), or ``None``
    without scipy. Untrained models have many near-identical queries, where nearest neighbours collide."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        return None
    rows, cols = linear_sum_assignment(dist.double().numpy())
    return torch.as_tensor(cols)[torch.as_tensor(rows).argsort()]
