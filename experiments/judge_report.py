#!/usr/bin/env python
"""The held-out check of ``judge='detections'`` against the output judge (docs/results.md#judge):
one table from the committed result files, and the rule's verdict.

    python -m experiments.judge_report     # print the table

Inputs: ``results/judge_heldout.json`` (``experiments/sweep_defaults.py --rows ours
'ours(judge=detections)' ...`` on the DETR and RT-DETR) and ``results/main_job_deimv2_vit_seed<N>.json``
(``experiments/main_job.py --rows ... ours:judge=detections ...`` on the ViT model).
"""
from __future__ import annotations

import glob
import os
import re
import statistics

from latte_plugin.storage import read_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results")
#: The allowance per model, fixed with the rule before the rows ran: the sweep's measured noise
#: (spread of the exact mAP over its 5 splits) on the detectors, an assumed 1 point on the ViT model.
NOISE = {"cond_detr": 0.013, "rtdetr": 0.003, "deimv2_vit": 0.010}
LABELS = {"cond_detr": "Conditional DETR", "rtdetr": "RT-DETR", "deimv2_vit": "DEIMv2, ViT backbone"}
#: (share, output judge's row, detection judge's row) in the sweep's names and in the main job's
SHARES = (("67%", "ours", "ours(judge=detections)"), ("83%", "ours@83%", "ours(judge=detections)@83%"))
VIT_ROWS = {"ours": "ours:auto", "ours@83%": "ours:auto@83%", "ours(judge=detections)": "ours:judge=detections",
            "ours(judge=detections)@83%": "ours:judge=detections@83%"}


def cells(results: str = RESULTS) -> list[dict]:
    """One cell per (model, split, budget, share) holding both judges' rows: ``{model, seed, budget,
    share, outputs, detections, configurations}`` (shares of the exact mAP kept)."""
    found: dict[tuple, dict] = {}
    path = os.path.join(results, "judge_heldout.json")
    for e in read_json(path, missing={"entries": []})["entries"]:
        if e["row"] != "exact":
            found[(e["model"], e["seed"], e["budget"], e["row"])] = e
    for path in sorted(glob.glob(os.path.join(results, "main_job_deimv2_vit_seed*.json"))):
        d, seed = read_json(path), int(re.search(r"seed(\d+)", path).group(1))
        budget = sum(((d.get("choices") or {}).get("ours:auto", {}).get("images") or {}).values()) or None
        for name, row in VIT_ROWS.items():
            if row in d["metrics"]:
                conf = ((d.get("choices") or {}).get(row, {}).get("selection") or {}).get("configuration")
                found[("deimv2_vit", seed, budget, name)] = {"kept": d["metrics"][row]["retained"], "configuration": conf}
    out = []
    for (model, seed, budget, name) in sorted(k for k in found if k[3] in {s[1] for s in SHARES}):
        for share, mine, theirs in SHARES:
            if name == mine and (model, seed, budget, theirs) in found:
                a, b = found[(model, seed, budget, mine)], found[(model, seed, budget, theirs)]
                out.append({"model": model, "seed": seed, "budget": budget, "share": share, "outputs": a["kept"],
                            "detections": b["kept"], "configurations": (a.get("configuration"), b.get("configuration"))})
    return out


def verdict(rows: list[dict]) -> str:
    """The rule of docs/results.md#judge applied to the cells."""
    if not rows:
        return "No held-out cell yet."
    losses = [r for r in rows if r["detections"] - r["outputs"] < -NOISE[r["model"]]]
    gain = statistics.mean(r["detections"] - r["outputs"] for r in rows)
    met = not losses and gain > 0
    lines = [f"Mean difference (detection judge - output judge) over {len(rows)} cells: {100 * gain:+.2f} points; "
             f"cells where the detection judge loses by more than the noise: {len(losses)}"
             + (" (" + "; ".join(f"{LABELS[r['model']]}, seed {r['seed']}, {r['budget']} images, {r['share']}"
                                 for r in losses) + ")" if losses else "") + ".",
             "**Rule met: `judge='auto'` may become the default.**" if met else
             "**Rule not met: the default stays `judge='outputs'`.**"]
    return "\n".join(lines)


def table(results: str = RESULTS) -> str:
    """The markdown table and the verdict."""
    rows = cells(results)
    head = ["model", "split seed", "calibration images", "linear", "output judge: % kept", "detection judge: % kept",
            "difference", "configurations (output / detection judge)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        conf = " / ".join(c or "-" for c in r["configurations"])
        lines.append("| " + " | ".join([LABELS[r["model"]], str(r["seed"]), str(r["budget"]), r["share"],
                                         f"{100 * r['outputs']:.1f}", f"{100 * r['detections']:.1f}",
                                         f"{100 * (r['detections'] - r['outputs']):+.1f}", conf]) + " |")
    return "\n".join(lines) + "\n\n" + verdict(rows)


def main(argv=None) -> str:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=RESULTS, help="folder of the result files (default: results/)")
    out = table(p.parse_args(argv).results)
    print(out)
    return out


if __name__ == "__main__":
    main()
