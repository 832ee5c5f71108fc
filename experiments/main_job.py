#!/usr/bin/env python
"""The README's main job: every LATTE row on the embedded checkpoint, evaluated by CocoMetric.

    python -m experiments.main_job [--config CFG] [--checkpoint CKPT] [--work-dir DIR] [--rows a b ...]

CFG is an mmdet config with a ``LinearizeHook`` (its settings are the base of every row).
Writes to DIR: ``latte_report.json`` (the spec keys for the ``latte`` row plus one entry per
row under ``metrics``), ``latte_calibrated.pth`` (the ``latte`` row), ``latte_sensitivity.png``
and ``latte_kept.png``, and prints the table.
"""
from __future__ import annotations

import dataclasses
import argparse
import json
import shlex
import math
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from latte_plugin.storage import CKPT_NAME, REPORT_NAME
from latte_plugin.console import first_paragraph

DEFAULT_CONFIG = "configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py"
DEFAULT_CHECKPOINT = "checkpoints/cond_detr_r18_synthetic.pth"


def format_table(rows: dict) -> str:
    w = max([18] + [len(n) for n in rows])
    head = (f"{'row':{w}s} {'linear':>6s} {'bbox_mAP':>8s} {'mAP@.5':>7s} {'% kept':>7s} "
            f"{'attn GFLOPs':>11s} {'speed-up':>9s} {'held-out dist.':>14s} {'held-out mse':>12s} {'min signal':>10s}")
    out = [head, "-" * len(head)]

    def num(x, fmt):
        return format(x, fmt) if x is not None else "-"

    for name, r in rows.items():
        kept = 100 * r["retained"] if not math.isnan(r["retained"]) else float("nan")
        out.append(f"{name:{w}s} {r['linear']:>6s} {r['bbox_mAP']:8.4f} {r['bbox_mAP_50']:7.4f} {kept:7.1f} "
                   f"{r['attention_gflops']:11.4f} {r['encoder_latency_ratio']:8.2f}x "
                   f"{num(r.get('heldout_distortion'), '14.4e')} {num(r.get('heldout_mse'), '12.4e')} "
                   f"{num(r.get('weakest_signal'), '10.2e')}")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The job's flags (the sweep builds its runs' arguments with it too)."""
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="'none' keeps the init weights (tests)")
    p.add_argument("--work-dir", default="work_dirs/main_job")
    p.add_argument("--rows", nargs="+", help="row names to run (default: all)")
    p.add_argument("--num-images", type=int, help="calibration images (default: the config's)")
    p.add_argument("--data-root", help="another generated split (same layout as data/synthetic), e.g. one made "
                                       "with another seed: calibrate on its train split, evaluate on its val split")
    p.add_argument("--input-size", type=int, help="run at N x N instead: every pipeline's Resize (the model must take "
                                                  "it: e.g. a RoPE backbone), with a --data-root generated at that size")
    p.add_argument("--timing-reps", type=int, default=20,
                   help="forwards timed per row for the speed-up column (best of N; default 20)")
    p.add_argument("--no-signal", action="store_true",
                   help="skip the signal column (one forward per candidate per calibration image; the headline skips it)")
    p.add_argument("--latte", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="change the config's LatteConfig for every row, e.g. --latte ratio=1.0 "
                        "'candidates=[\"hf.model.conv_encoder.backbone.model.layer.*.attention\"]' (values as "
                        "JSON, else a string)")
    p.add_argument("--results", help="also write the results file the README's tables are made from (results/...)")
    p.add_argument("--update", action="store_true",
                   help="with --results: replace only the rows run in the existing file (their metrics and choices), "
                        "recording the command under 'updates'; the other rows keep the run that made them")
    p.add_argument("--verbose", action="store_true", help="print the frameworks' logs (default: WORK_DIR/main_job.log)")
    return p


def main(argv=None) -> dict:
    p = parser()
    a = p.parse_args(argv)
    if a.timing_reps < 1:
        p.error(f"--timing-reps {a.timing_reps}: give at least 1")
    from latte_plugin.console import quiet, say

    log_path = os.path.join(a.work_dir, "main_job.log")
    say(f"[latte] main job: {a.config} on {a.checkpoint}" + ("" if a.verbose else f" (log: {log_path})"))
    from latte_plugin.storage import CheckpointError

    try:
        with quiet(log_path, enabled=not a.verbose):
            report = run(a)
    except CheckpointError as e:  # one line that names the file and says what to do
        raise SystemExit(f"error: {e}") from None
    say(format_table(report.pop("_table_rows")))
    say(f"report: {os.path.join(a.work_dir, REPORT_NAME)}\ncheckpoint: {os.path.join(a.work_dir, CKPT_NAME)}\n"
        f"plots: {a.work_dir}/latte_sensitivity.png {a.work_dir}/latte_kept.png"
        + (f"\nresults: {a.results}" if a.results else "") + f"\n({report['seconds']:.0f} s)")
    return report


def use_data_root(cfg, root: str) -> None:
    """Points the config's datasets and evaluators at ``root`` (a generated split)."""
    if not os.path.isfile(os.path.join(root, "annotations", "instances_val.json")):
        raise SystemExit(f"--data-root {root}: no annotations/instances_val.json there; generate it with "
                         f"python -m latte_plugin.data.synthetic {root} --seed N")
    root = root.rstrip("/") + "/"
    for loader in ("train_dataloader", "val_dataloader", "test_dataloader"):
        if cfg.get(loader):
            cfg[loader].dataset.data_root = root
    for ev in ("val_evaluator", "test_evaluator"):
        if cfg.get(ev):
            cfg[ev].ann_file = root + "annotations/instances_val.json"


def use_input_size(cfg, side: int) -> None:
    """Sets every dataloader pipeline's ``Resize`` to ``side`` x ``side``."""
    for loader in ("train_dataloader", "val_dataloader", "test_dataloader"):
        for step in (cfg.get(loader) or {}).get("dataset", {}).get("pipeline", []):
            if step.get("type") == "Resize":
                step["scale"] = (side, side)


def results_file(report: dict, a: argparse.Namespace) -> dict:
    """What the README's tables are made from: per-row metrics, the default row's choices, timing."""
    keep = ("default_row", "metrics", "rows", "config", "checkpoint", "seconds", "retained", "attention_gflops", "signal")
    out = {k: report[k] for k in keep if k in report}
    out["choices"] = {name: {"linearized": r["linearized"], "images": r["selection"].get("images"),
                             "heldout_distortion": r["selection"].get("heldout_distortion"),
                             "selection": {k: r["selection"].get(k) for k in (
                                 "method", "chosen", "configuration", "comparison", "target", "halves", "judge_images",
                                 "greedy_images", "heldout", "compensation", "searched_again", "confirmed")},
                             "layers": {n: dict({k: f.get(k) for k in ("steps", "refit_reg", "correction", "applied",
                                                                       "heldout_mse", "heldout", "choice", "kernel",
                                                                       "mode")},
                                                compensated=(f.get("compensated") or {}).get("correction"))
                                        for n, f in r["fit"].items()},
                             **({"speed": {k: r["speed"][k] for k in ("predicted_speedup", "measured_speedup", "assignment",
                                                                      "chosen", "front", "marks", "measure", "cost")}}
                                if "speed" in r else {})}
                      for name, r in report.get("row_reports", {}).items()}
    out["command"] = "python -m experiments.main_job " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("config", a.config), ("checkpoint", a.checkpoint),
                                                     ("num_images", a.num_images), ("data_root", a.data_root),
                                                     ("input_size", a.input_size)) if v) + (
        " --latte " + " ".join(shlex.quote(x) for x in a.latte) if a.latte else "") + (
        " --rows " + " ".join(f"'{r}'" if "%" in r or " " in r else r for r in a.rows) if a.rows else "")
    return out


def updated(new: dict, path: str) -> dict:
    """The results file at ``path`` with the rows of ``new`` replaced (metrics and choices) and
    ``new``'s command added under ``updates``."""
    if not os.path.isfile(path):
        raise SystemExit(f"--update: {path} does not exist; run without --update to write it")
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    for key in ("metrics", "choices"):
        old.setdefault(key, {}).update(new.get(key, {}))
    for row in new.get("metrics", {}):  # a row refused now keeps no choice from an earlier run
        if row not in new.get("choices", {}):
            old["choices"].pop(row, None)
    exact_map = old["metrics"].get("exact", {}).get("bbox_mAP")
    if exact_map:  # a run without the exact row keeps its share against the file's
        for row, m in old["metrics"].items():
            if m.get("bbox_mAP") is not None:
                m["retained"] = m["bbox_mAP"] / exact_map
    old.setdefault("rows", {}).update(new.get("rows", {}))  # row name -> its spec and linearized layers
    if old.get("default_row") in old["metrics"]:
        old["retained"] = old["metrics"][old["default_row"]].get("retained")
    old["updates"] = old.get("updates", []) + [{"command": new["command"] + " --update", "rows": list(new["metrics"]),
                                                "date": time.strftime("%Y-%m-%d")}]
    return old


def run(a: argparse.Namespace) -> dict:
    """Builds the Runner (without the hook: this job calibrates row by row), runs the rows and
    writes the report, the results file and the plots."""
    from latte_plugin.storage import atomic_write_json
    from latte_plugin.mmdet.workflow import save_calibrated_checkpoint
    from latte_plugin.viz import plot_kept, plot_sensitivity
    from experiments.main_job_rows import DEFAULT_ROW, ROWS, named_row, row_key, run_rows

    t0 = time.time()
    runner, base, batches = build(a)
    unknown = [n for n in (a.rows or []) if named_row(n) is None]
    if unknown:
        raise SystemExit(f"--rows: unknown row {unknown[0]!r}; see python -m experiments.main_job_rows, or ours:speedup=X")
    # the table keeps ROWS' order; speed rows follow in the order given
    rows = [r for r in ROWS if not a.rows or r.name in a.rows] + [
        named_row(n) for n in (a.rows or []) if all(r.name != n for r in ROWS)]
    ckpt_path = os.path.join(a.work_dir, CKPT_NAME)
    default = DEFAULT_ROW if any(r.name == DEFAULT_ROW for r in rows) else next(
        (r.name for r in rows if r.kind == "latte"), None)
    # rows with the default's settings are calibrated once, under the first such row's name
    saved_as = next((r.name for r in rows if default and row_key(base, r) == row_key(
        base, next(x for x in rows if x.name == default))), None)

    def on_calibrated(name: str, rep: dict) -> None:
        if name == saved_as:
            save_calibrated_checkpoint(runner.model, rep, ckpt_path)

    out = run_rows(runner, batches, base, rows, timing_reps=a.timing_reps, on_calibrated=on_calibrated)
    report = assemble_report(out["rows"], out["reports"], rows, default, a, t0)
    atomic_write_json(report, os.path.join(a.work_dir, REPORT_NAME))
    if a.results:
        atomic_write_json(updated(results_file(report, a), a.results) if a.update else results_file(report, a), a.results)
    if "latte" in out["reports"]:  # the paper's score, per layer
        plot_sensitivity(out["reports"]["latte"], os.path.join(a.work_dir, "latte_sensitivity.png"))
    plot_kept(report["metrics"], os.path.join(a.work_dir, "latte_kept.png"))
    report["_table_rows"] = out["rows"]
    return report


def build(a: argparse.Namespace):
    """``(runner, base settings, calibration batches)``: the config's Runner without its
    LinearizeHook (this job calibrates row by row), LATTE cores installed, the checkpoint
    checked (keys and shapes) and loaded."""
    from mmengine.config import Config

    from latte_plugin.adapter import take_batches
    from latte_plugin.mmdet.calibrate import ADAPTER, build_calibration_loader
    from latte_plugin.mmdet.workflow import (drop_linearize_hook, hook_latte_settings, runner_with_checkpoint,
                                             unformatted)

    cfg = unformatted(Config.fromfile(a.config))
    if a.data_root:
        use_data_root(cfg, a.data_root)
    if a.input_size:
        use_input_size(cfg, a.input_size)
    try:
        base = hook_latte_settings(cfg, a.config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if a.num_images:
        base = dataclasses.replace(base, num_images=a.num_images)
    try:
        base = dataclasses.replace(base, **latte_changes(a.latte))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: --latte {' '.join(a.latte)}: {e}") from None
    base = dataclasses.replace(base, signal=base.signal and not a.no_signal)
    drop_linearize_hook(cfg)
    cfg.load_from = None  # only --checkpoint ('none': the init weights)
    cfg.work_dir = a.work_dir
    cfg.default_hooks.checkpoint = None
    runner = runner_with_checkpoint(cfg, None if a.checkpoint == "none" else a.checkpoint, latte=base)
    batches, _ = take_batches(build_calibration_loader(cfg, 1, "test", base.seed), base.num_images, (0, 1), ADAPTER)
    return runner, base, batches


def latte_changes(pairs: list[str]) -> dict:
    """``FIELD=VALUE`` pairs as LatteConfig changes (each value read as JSON, else kept a string)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{pair!r} is not FIELD=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def assemble_report(res: dict, reps: dict, rows: list, default, a: argparse.Namespace, t0: float) -> dict:
    """The job's report: the default row's calibration report, every row's metrics and choices."""
    report: dict = {}
    if default in reps:
        report["default_row"] = default
        report.update({k: reps[default][k] for k in ("variant", "candidates", "sensitivity", "linearized", "params",
                                                       "sigma_mean", "fit", "selection", "tokens")
                       if k in reps[default]})
        # measured once per job (by the first calibrated row): the exact model's, whichever row
        report["signal"] = next((rep["signal"] for rep in reps.values() if rep.get("signal")), {})
    metrics = {name: {k: r.get(k) for k in ("bbox_mAP", "bbox_mAP_50", "retained", "linear", "attention_gflops",
                                            "encoder_latency_ratio", "heldout_distortion", "heldout_fidelity",
                                            "heldout_mse", "weakest_signal", "calibration_seconds",
                                            "calibration_shared_with", "predicted_speedup", "measured_speedup",
                                            "refused") if k in r or k not in ("predicted_speedup", "measured_speedup",
                                                                              "refused")}
               for name, r in res.items()}
    if "exact" in res and default in res:
        metrics["linearized"] = dict(metrics[default])
        report["retained"] = res[default]["retained"]
        report["attention_gflops"] = {"exact": res["exact"]["attention_gflops"],
                                      "linearized": res[default]["attention_gflops"]}
    report["metrics"] = metrics
    report["rows"] = {r.name: {"changes": r.changes, "kind": r.kind, "linearized": res[r.name]["linearized"]}
                      for r in rows}
    report["row_reports"] = {k: {kk: v[kk] for kk in ("sensitivity", "linearized", "params", "fit", "selection", "speed")
                                 if kk in v}
                             for k, v in reps.items()}
    report.update(config=a.config, checkpoint=a.checkpoint, seconds=time.time() - t0)
    return report


if __name__ == "__main__":
    main()
