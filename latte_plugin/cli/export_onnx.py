#!/usr/bin/env python
"""Export a calibrated mmdet detector (the DETR family or ``HFRTDETR``) to ONNX, and check it.

    python tools/export_onnx.py CFG CKPT --out model.onnx [--shape H W] [--opset 17] [--exact]
        [--eval] [--results FILE.json] [--cfg-options k=v ...]

CKPT is a calibrated checkpoint (``tools/calibrate.py``'s ``latte_calibrated.pth``): the graph
is the hybrid as it runs at inference, linear layers linear, the rest exact. ``--exact``
exports every layer exact (the baseline; a plain checkpoint works too).

The graph's input ``pixels`` ``(B, 3, H, W)`` is what mmdet's ``DetDataPreprocessor`` gives
(normalised, padded to the divisor); batch, height and width are dynamic. Its outputs are the
head's **raw outputs** of the last decoder layer, ``logits (B, Q, C')`` and ``boxes (B, Q, 4)``
(normalised ``cx, cy, w, h``); post-processing (top-k, rescaling) is the detector's own and
stays outside the graph (:func:`latte_plugin.mmdet.export.predict_from_raw`). Only standard
ONNX operators are used (checked). Dynamic-mode layers export their linear path (warned).

``--eval`` evaluates the config's test split twice with the Runner's own test loop and
``CocoMetric``: the torch hybrid, then onnxruntime's outputs through the same post-processing,
and reports both mAPs and the largest output difference, position by position and with
queries matched (RT-DETR's query top-k may list two nearly tied queries in the other order:
:func:`latte_plugin.export.query_matched_diff`). Images go one at a time (DETR-family graphs
take no padding mask).
"""
from __future__ import annotations

import argparse
import os
import time



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="the .onnx file to write")
    p.add_argument("--shape", type=int, nargs=2, metavar=("H", "W"),
                   help="example input size (default: the first test image after the test pipeline)")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--exact", action="store_true", help="export every attention layer exact (the baseline)")
    p.add_argument("--eval", action="store_true", help="CocoMetric of the torch model and of onnxruntime")
    p.add_argument("--results", help="write the numbers to this JSON file")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--cfg-options", nargs="+", default=[])
    return p.parse_args(argv)


def build_runner(args: argparse.Namespace):
    """The config's Runner with the checkpoint checked (keys and shapes) and loaded: LATTE state
    from it, never recalibrated (``--exact``: the original attention modules, LATTE's buffers ignored)."""
    from latte_plugin.mmdet.workflow import drop_linearize_hook, load_config, runner_with_checkpoint, set_linearize_hook

    cfg = load_config(args.config, args.cfg_options)
    if args.exact:
        drop_linearize_hook(cfg)
    else:
        set_linearize_hook(cfg, args.config, calibrate="never")
    cfg.work_dir = args.work_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "export_work")
    cfg.default_hooks.checkpoint = None
    cfg.test_dataloader.batch_size = 1  # one image at a time, as the graph takes it
    return runner_with_checkpoint(cfg, args.checkpoint)


def example_input(runner, shape):
    """The example input: random at ``shape``, else the first test image as the preprocessor gives it."""
    import torch

    if shape:
        return torch.rand(1, 3, *shape)
    batch = next(iter(runner.test_dataloader))
    return runner.model.data_preprocessor(batch, False)["inputs"][:1]


def export(args: argparse.Namespace, runner) -> dict:
    from latte_plugin.nn.install import find_latte_layers
    from latte_plugin.export import export_onnx, max_abs_diff, run_onnx
    from latte_plugin.mmdet.export import RawOutputs

    det = runner.model
    layers = find_latte_layers(det)
    linear = [n for n, layer in layers.items() if layer.mode != "exact"]
    wrapped = RawOutputs(det).eval()
    x = example_input(runner, args.shape)
    t0 = time.time()
    export_onnx(wrapped, x, args.out, input_names=["pixels"], output_names=["logits", "boxes"],
                dynamic_axes={"pixels": {0: "batch", 2: "height", 3: "width"}}, opset=args.opset)
    import torch

    with torch.no_grad():
        diff = max_abs_diff(wrapped(x), run_onnx(args.out, x))
    return {"onnx": args.out, "linear": linear, "export_s": round(time.time() - t0, 1),
            "input_shape": list(x.shape), "max_abs_diff": diff, "opset": args.opset}


def evaluate(runner, onnx_path: str) -> dict:
    """CocoMetric of the torch model, then of onnxruntime's outputs through the same post-processing."""
    import torch

    from latte_plugin.export import query_matched_diff, run_onnx, session_for
    from latte_plugin.mmdet.export import RawOutputs, predict_from_raw

    det = runner.model
    raw = RawOutputs(det).eval()
    torch_metrics = runner.test()
    session = session_for(onnx_path)
    worst, matched, reordered = [0.0], [0.0], [0]

    def ort_predict(batch_inputs, batch_data_samples, rescale: bool = True):
        logits, boxes = run_onnx(onnx_path, batch_inputs, session=session)
        with torch.no_grad():
            ref = raw(batch_inputs)
        worst[0] = max(worst[0], float((ref[0] - logits).abs().max()), float((ref[1] - boxes).abs().max()))
        diff, moved = query_matched_diff(ref, (logits, boxes))
        matched[0], reordered[0] = max(matched[0], diff), reordered[0] + int(moved)
        return predict_from_raw(det, logits, boxes, tuple(batch_inputs.shape[-2:]), batch_data_samples, rescale)

    det.predict = ort_predict
    try:
        ort_metrics = runner.test()
    finally:
        del det.predict
    pick = lambda m: {k.split("/")[-1]: float(v) for k, v in m.items() if k.endswith(("bbox_mAP", "bbox_mAP_50"))}
    return {"torch": pick(torch_metrics), "onnxruntime": pick(ort_metrics), "max_abs_diff_val": worst[0],
            "max_query_matched_diff_val": matched[0], "images_with_reordered_queries": reordered[0],
            "images": len(runner.test_dataloader.dataset)}


def main(argv=None) -> dict:
    from latte_plugin.console import quiet, say

    from latte_plugin.storage import CheckpointError

    args = parse_args(argv)
    if not os.path.isfile(args.config):
        raise SystemExit(f"error: {args.config}: no such config file; give the path of an mmdet config")
    with quiet(os.path.join(os.path.dirname(os.path.abspath(args.out)), "export_onnx.log")):
        try:
            runner = build_runner(args)
        except (CheckpointError, ValueError, FileNotFoundError) as e:  # one line that names the file (or the config) and what to do
            raise SystemExit(f"error: {e}") from None
        result = export(args, runner)
        say(f"[latte] wrote {result['onnx']} ({len(result['linear'])} linear layers; onnxruntime vs torch on the "
            f"example input: max |diff| {result['max_abs_diff']:.2e})")
        if args.eval:
            result["metrics"] = evaluate(runner, args.out)
            t, o = result["metrics"]["torch"]["bbox_mAP"], result["metrics"]["onnxruntime"]["bbox_mAP"]
            say(f"[latte] CocoMetric bbox_mAP: torch {t:.3f}, onnxruntime {o:.3f}")
    result.update(config=args.config, checkpoint=args.checkpoint, exact=args.exact)
    if args.results:
        from latte_plugin.storage import atomic_write_json

        atomic_write_json(result, args.results)
    return result


if __name__ == "__main__":
    main()
