#!/usr/bin/env python
"""Which configuration is the noise rule's reference: the evidence behind
``latte_plugin.calibration.config.EVIDENCE_REFERENCE`` and ``EVIDENCE_SELECTIONS``.

    python -m experiments.reference_evidence [--pattern 'results/sweep_defaults_*.json'] [--json results/reference_evidence.json]

Reads only the cross-fitted judge losses that every calibration of the design sweep
(``results/sweep_defaults_*.json``, seeds 202-606, both 256 px detectors, 8-64 images, 67% and
83%) recorded for each of its candidates: no val mAP, no test score. For each candidate pair
(selection + correction rule): its mean and worst log ratio to the calibration's best loss, how
often it was the best (ties to every tied pair), and how often the backward search's loss
equalled the greedy search's under the same rule (then the backward search adds nothing but cost).
``--pattern 'results/design_rules_diag.json'`` reads the same design splits calibrated again by the
defaults once ``diag`` joined the correction rules (``results/reference_evidence_diag.json``).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def calibrations(pattern: str = "results/sweep_defaults_*.json") -> list[dict]:
    """``[{model, seed, budget, row, losses}]`` of every design calibration that compared candidates."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
        with open(path, encoding="utf-8") as f:
            for e in json.load(f)["entries"]:
                losses = (e.get("comparison") or {}).get("losses")
                if losses:
                    out.append({k: e[k] for k in ("model", "seed", "budget", "row")} | {"losses": losses})
    return out


def summary(runs: list[dict]) -> dict:
    """Per pair: ``{mean_log_ratio, worst_log_ratio, best_count}``; and the backward-equals-greedy count."""
    pairs: dict[str, dict] = {}
    same_backward = 0
    for r in runs:
        best = min(r["losses"].values())
        for name, loss in r["losses"].items():
            p = pairs.setdefault(name, {"ratios": [], "best_count": 0})
            p["ratios"].append(math.log(loss / best) if best > 0 else 0.0)
            p["best_count"] += int(loss == best)
        rules = {n.split("+", 1)[1] for n in r["losses"] if n.startswith("backward+")}
        same_backward += int(all(r["losses"].get(f"backward+{q}") == r["losses"].get(f"greedy+{q}") for q in rules))
    table = {n: {"mean_log_ratio": sum(p["ratios"]) / len(p["ratios"]), "worst_log_ratio": max(p["ratios"]),
                 "best_count": p["best_count"]} for n, p in pairs.items()}
    return {"calibrations": len(runs), "pairs": dict(sorted(table.items(), key=lambda kv: kv[1]["mean_log_ratio"])),
            "backward_equals_greedy": same_backward}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pattern", default="results/sweep_defaults_*.json",
                   help="the design calibrations' results files (a glob under the repository root)")
    p.add_argument("--json", help="write the summary here (e.g. results/reference_evidence.json)")
    a = p.parse_args(argv)
    runs = calibrations(a.pattern)
    if not runs:
        raise SystemExit(f"no design calibration with judge losses in {a.pattern}: run experiments.sweep_defaults first")
    out = summary(runs)
    out["reference"] = next(iter(out["pairs"]))
    pattern = "" if a.pattern == p.get_default("pattern") else f" --pattern '{a.pattern}'"
    out["command"] = "python -m experiments.reference_evidence" + pattern + (f" --json {a.json}" if a.json else "")
    for name, row in out["pairs"].items():
        print(f"{name:18s} mean log ratio to the best {row['mean_log_ratio']:.3f}, worst {row['worst_log_ratio']:.3f}, "
              f"best in {row['best_count']}/{out['calibrations']}")
    print(f"backward's losses equal greedy's in {out['backward_equals_greedy']}/{out['calibrations']}; "
          f"reference: {out['reference']}")
    if a.json:
        from latte_plugin.storage import atomic_write_json

        atomic_write_json(out, a.json)
    return out


if __name__ == "__main__":
    main()
