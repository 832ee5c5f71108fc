#!/usr/bin/env python
"""Prints the README results table (markdown) from main-job reports.

    python tools/results_table.py work_dirs/main_job/cond_detr/latte_report.json [more.json ...]

Rows of later reports replace rows of the same name in earlier ones (rows are deterministic:
the same settings, seed and checkpoint give the same numbers); order follows the first
report that has each row, then the package's row list.
"""
from __future__ import annotations

import json
import math
import sys


def main(paths: list[str]) -> str:
    rows: dict[str, dict] = {}
    exact = None
    for p in paths:
        rep = json.load(open(p))
        for name, m in rep["metrics"].items():
            if name == "linearized":
                continue
            rows[name] = dict(m)
            if name == "exact":
                exact = m["bbox_mAP"]
    out = ["| row | linear | bbox mAP | mAP@.5 | % kept | attn GFLOPs | held-out distortion | held-out layer MSE |",
           "|---|---|---|---|---|---|---|---|"]

    def num(x, fmt):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    for name, m in rows.items():
        kept = 100 * m["bbox_mAP"] / exact if exact else float("nan")
        out.append(f"| {name} | {m['linear']} | {m['bbox_mAP']:.3f} | {m['bbox_mAP_50']:.3f} | {kept:.1f} | "
                   f"{m['attention_gflops']:.4f} | {num(m.get('heldout_distortion'), '.3e')} | "
                   f"{num(m.get('heldout_mse'), '.3e')} |")
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
