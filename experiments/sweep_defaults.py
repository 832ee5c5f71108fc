#!/usr/bin/env python
"""Do the defaults ever lose? The package defaults against the paper's protocol and the
previous defaults, on generated splits no choice in the project has seen, at several budgets.

    python -m experiments.sweep_defaults [--seeds 202 303 404 505 606] [--budgets 8 16 32 64]
        [--models cond_detr rtdetr] [--sequence-budgets 8 128] [--rows ours 'ours(judge=detections)' ...]
        [--results results/sweep_rule_cond_detr.json]

For each seed: a split generated with it (``data/sweep/seed<N>``: 200 train, 200 val images
at 256x256; for the ViT detector ``--models vit``, ``data/sweep/vit_seed<N>``: 200 and 200 two-key
images at 512x512, as it was trained), and for each embedded detector the exact model and, at each budget (the first N
train images of the calibration sampler's order), the rows ``latte`` (the paper's protocol),
``old default`` (the previous defaults' settings: greedy + refit, no compensation, a quarter
held out; run by the current code, so its greedy search is cross-fitted too),
``ours:reference=paper`` (the earlier choice rule, the paper's protocol as its reference),
``ours:final_set=search`` (the sweep's ``ours``: the defaults before the final set was confirmed
on unsearched images) and ``ours:auto`` (the sweep's ``confirmed``: the package defaults; plus
each at 83% at 32 images), each scored by mmdet's CocoMetric on the split's val images. The sequence model (``experiments/sequence_task.py``) runs the same three
configurations with each seed's calibration sequences at each sequence budget (one per batch),
scored on 2,000 test sequences by the cosine of its pooled output to the exact model's.

The results file is rewritten after every row (atomic), and a run given the same file resumes
where it stopped. Nothing here chooses anything. The design sweep (``results/sweep_defaults_*``,
seeds 202-606, run before the current rule) is evidence the rule was designed on; the rule's own
sweep (``results/sweep_rule_*``) uses seeds 1313-1717, fixed before it ran and never looked at
before (seed 101 and 707/808 are excluded too: their val mAP was seen, docs/history.md). The
confirmed final set was built after two of those splits' misses were looked at (the ViT
detector's 1313 and 1717), so its held-out splits are 1818-2020, fixed before they ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from latte_plugin.calibration.config import PREVIOUS_CORRECTION_RULES
from latte_plugin.storage import atomic_write_json, read_json

MODELS = {"cond_detr": ("configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py", "checkpoints/cond_detr_r18_synthetic.pth"),
          "rtdetr": ("configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py", "checkpoints/rtdetr_r18_synthetic.pth"),
          "vit": ("configs/mmdet/embedded/deimv2_vit6_synthetic_latte.py", "checkpoints/deimv2_vit6_synthetic.pth")}
#: sweep row -> main-job row
DETECTOR_ROWS = {"paper": "latte", "previous": "old default", "earlier": "ours:reference=paper",
                 "ours": "ours:final_set=search", "ours@83%": "ours:final_set=search@83%",
                 "earlier@83%": "ours:reference=paper@83%", "confirmed": "ours:auto", "confirmed@83%": "ours:auto@83%"}
#: rows run only when named (``--rows``): the detection judge, the final set searched again on
#: every search image even where the halves agree (``final_set='pooled'``), one (alpha, rho) per
#: head (``per_head=True``), and the searches comparing outputs with the query slots matched by box
#: (``search='matched'``), and the correction with the diagonal term (``correction='diag'``), each the
#: package defaults with that one change
EXTRA_ROWS = {"ours(judge=detections)": "ours:judge=detections", "ours(judge=detections)@83%": "ours:judge=detections@83%",
              "pooled": "ours:final_set=pooled", "pooled@83%": "ours:final_set=pooled@83%",
              "per_head": "ours:per_head", "per_head@83%": "ours:per_head@83%",
              "matched": "ours:search=matched", "matched@83%": "ours:search=matched@83%",
              "diag": "ours:correction=diag", "diag@83%": "ours:correction=diag@83%",
              "rules_previous": "ours:rules=previous", "rules_previous@83%": "ours:rules=previous@83%"}
#: every row ``--rows`` can name: the sweep's name -> the main job's row
ALL_ROWS = {**DETECTOR_ROWS, **EXTRA_ROWS}
#: the sequence model's rows (``ours``: ``final_set='search'``; ``confirmed``: the defaults)
SEQUENCE_ROWS = ("paper", "previous", "earlier", "ours", "confirmed")
#: the sequence model's rows run only when ``--rows`` names them, and their settings
SEQUENCE_EXTRA = {"pooled": {"final_set": "pooled"}, "diag": {"correction": "diag"},
                  "rules_previous": {"correction_rules": PREVIOUS_CORRECTION_RULES}}
SPLIT = {"train": 200, "val": 200, "size": 256}
#: the ViT detector's splits: two-key images at 512 px, as its training data (data/sweep/vit_seed<N>)
SPLITS = {"vit": {**SPLIT, "size": 512, "two_keys": 0.75}}
#: rows run only at these budgets (the issue's 83% goal is stated at 32 images)
ONLY_AT = {"ours@83%": (32,), "earlier@83%": (32,), "confirmed@83%": (32,), "ours(judge=detections)@83%": (32,),
           "pooled@83%": (32,), "per_head@83%": (32,), "matched@83%": (32,), "diag@83%": (32,),
           "rules_previous@83%": (32,)}


def cosines_path(results_path: str) -> str:
    """The sidecar of a sweep's results file that holds the sequence model's per-test-sequence
    cosines (``results/sweep_rule_sequence.json`` -> ``results/sweep_rule_sequence_cosines.safetensors``)."""
    return os.path.splitext(results_path)[0] + "_cosines.safetensors"


def cosine_key(seed: int, budget: int, row: str) -> str:
    """The sidecar key of one sequence entry's cosines."""
    return f"sequence/{seed}/{budget}/{row}"


def save_cosines(results_path: str, key: str, cosines) -> None:
    """Adds ``cosines`` ``(S,)`` under ``key`` to the results file's sidecar (safetensors, atomic)."""
    if not results_path:
        return
    from safetensors.torch import load_file, save

    from latte_plugin.storage import atomic_write

    side = cosines_path(results_path)
    tensors = load_file(side) if os.path.isfile(side) else {}
    tensors[key] = cosines.detach().float().contiguous()
    data = save(tensors, metadata={"what": "cosine of each test sequence's pooled output to the exact model's",
                                   "results": os.path.basename(results_path)})
    atomic_write(side, lambda f: f.write(data))


def _done(results: dict, **key) -> bool:
    return any(all(e.get(k) == v for k, v in key.items()) for e in results["entries"])


def _finish(results: dict, path: str, t0: float) -> dict:
    """Adds this run's wall time (since ``t0``) to ``results["seconds"]`` and writes the file (atomic)."""
    results["seconds"] = results.get("seconds", 0.0) + round(time.time() - t0, 1)
    if path:
        atomic_write_json(results, path)
    return results


def _record(results: dict, path: str, entry: dict) -> None:
    results["entries"].append(entry)
    if path:
        atomic_write_json(results, path)
    from latte_plugin.console import say

    say(" ".join(f"{k}={v}" for k, v in entry.items() if k in ("model", "seed", "budget", "row", "bbox_mAP", "kept",
                                                                 "cosine", "configuration")))


def _split(seed: int, model: str) -> str:
    from latte_plugin.data.synthetic import make_synthetic_coco

    spec = SPLITS.get(model, SPLIT)
    root = os.path.join(ROOT, "data", "sweep", f"{model}_seed{seed}" if model in SPLITS else f"seed{seed}")
    make_synthetic_coco(root, spec["train"], spec["val"], spec["size"], seed, two_keys=spec.get("two_keys", 0.0))
    return root


def _choice(rep: dict) -> dict:
    sel = rep.get("selection", {})
    return {"linearized": rep.get("linearized"), "configuration": sel.get("configuration"),
            "comparison": {k: v for k, v in (sel.get("comparison") or {}).items() if k != "layers"},
            "halves_sets": (sel.get("comparison") or {}).get("layers", {}).get(
                str(sel.get("configuration")).replace("+compensation", "")),
            "searched_again": bool(sel.get("searched_again")), "confirmed": sel.get("confirmed"),
            "compensated": bool((sel.get("compensation") or {}).get("kept"))}


def job_arguments(model: str, seed: int, num_images: int) -> argparse.Namespace:
    """The main job's arguments (its own parser, so every flag has its default) for one model and split."""
    from experiments.main_job import parser

    config, ckpt = MODELS[model]
    return parser().parse_args(["--config", config, "--checkpoint", ckpt, "--data-root", _split(seed, model),
                                "--num-images", str(num_images),
                                "--work-dir", os.path.join(ROOT, "work_dirs", "sweep", f"{model}_seed{seed}")])


def sweep_detector(model: str, seed: int, budgets: list, results: dict, path: str,
                   names: tuple = tuple(DETECTOR_ROWS)) -> None:
    """The exact row and every (budget, row of ``names``) not yet in ``results`` for one model and split."""
    from experiments.main_job import build
    from experiments.main_job_rows import ROWS, run_row

    rows = {r.name: r for r in ROWS}
    todo = [(b, r) for b in budgets for r in names if b in ONLY_AT.get(r, (b,))
            and not _done(results, model=model, seed=seed, budget=b, row=r)]
    if not todo and _done(results, model=model, seed=seed, row="exact"):
        return
    runner, base, batches = build(job_arguments(model, seed, max(budgets)))
    exact = next((e for e in results["entries"] if e["model"] == model and e["seed"] == seed and e["row"] == "exact"), None)
    if exact is None:
        r = run_row(runner, batches, base, rows["exact"], {}, 1, None)
        exact = {"model": model, "seed": seed, "budget": None, "row": "exact", "bbox_mAP": r["bbox_mAP"], "kept": 1.0}
        _record(results, path, exact)
    for budget, name in todo:
        reports: dict = {}
        row = rows[ALL_ROWS[name]]
        r = run_row(runner, batches[:budget], dataclasses.replace(base, num_images=budget), row, reports, 1, None)
        _record(results, path, {"model": model, "seed": seed, "budget": budget, "row": name, "bbox_mAP": r["bbox_mAP"],
                                "kept": r["bbox_mAP"] / exact["bbox_mAP"], "linear": r["linear"],
                                "calibration_seconds": round(r["calibration_seconds"], 1),
                                **_choice(reports.get(row.name, {}))})


def sweep_sequence(seed: int, budgets: list, results: dict, path: str, extra: tuple = (),
                   rows: tuple = SEQUENCE_ROWS) -> None:
    """The sequence model's ``rows`` (of ``SEQUENCE_ROWS``) and ``extra`` (of ``SEQUENCE_EXTRA``) at each
    budget, calibrated on ``seed``'s sequences."""
    import torch

    from experiments import sequence_job as job
    from experiments import sequence_task as task
    from latte_plugin.data.sequence import RetrievalSpec, retrieval_batch

    todo = [(b, r) for b in budgets for r in dict.fromkeys((*rows, *extra))
            if not _done(results, model="sequence", seed=seed, budget=b, row=r)]
    if not todo:
        return
    spec, exact = RetrievalSpec(), task.load(task.CHECKPOINT)
    tokens, _ = retrieval_batch(spec, max(budgets), seed)
    test = retrieval_batch(spec, 2000, task.TEST_SEED)
    with torch.no_grad():
        exact_pooled = torch.cat([exact(test[0][i:i + 500])[1] for i in range(0, 2000, 500)])
    changes = {"paper": job.PAPER, "previous": job.PREVIOUS, "earlier": job.EARLIER, "ours": {"final_set": "search"},
               "confirmed": {}, **SEQUENCE_EXTRA}
    for budget, name in todo:
        r = job.run_row(name, changes[name], exact, list(tokens[:budget].split(1)), test, exact_pooled)
        # the per-sequence cosines first: an entry is never on file without them
        save_cosines(path, cosine_key(seed, budget, name), r.pop("cosines"))
        _record(results, path, {"model": "sequence", "seed": seed, "budget": budget, "row": name,
                                "cosine": r["cosine"], "accuracy": r["accuracy"], "linearized": r.get("linearized"),
                                "configuration": r.get("configuration")})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[202, 303, 404, 505, 606])
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS) + ["none"])
    p.add_argument("--sequence-budgets", type=int, nargs="*", default=[8, 128])
    p.add_argument("--rows", nargs="+", default=list(DETECTOR_ROWS), choices=list(ALL_ROWS),
                   help="detector rows to run")
    p.add_argument("--sequence-rows", nargs="+", default=list(SEQUENCE_ROWS), choices=[*SEQUENCE_ROWS, *SEQUENCE_EXTRA],
                   help="the sequence model's rows (those of --rows it has run too)")
    p.add_argument("--results", help="results file (resumed if it exists), e.g. results/sweep_defaults.json")
    a = p.parse_args(argv)
    from latte_plugin.console import quiet

    results, t0 = read_json(a.results, missing={"entries": []}), time.time()
    args = [os.path.relpath(x, ROOT) if os.path.isabs(x) and x.startswith(ROOT) else x for x in (argv or sys.argv[1:])]
    command = "python -m experiments.sweep_defaults " + shlex.join(args)
    # a file grown by several runs (budgets added later) keeps every command that wrote to it
    commands = [c for c in results.get("commands", [results.get("command")]) if c and c != command]
    rows = {**results.get("rows", {}), **{r: ALL_ROWS[r] for r in a.rows}}
    results.update(command=command, commands=[*commands, command], split=SPLIT, splits=SPLITS, rows=rows)
    for seed in a.seeds:
        if a.sequence_budgets:
            sweep_sequence(seed, a.sequence_budgets, results, a.results, tuple(r for r in a.rows if r in SEQUENCE_EXTRA),
                           tuple(a.sequence_rows))
        for model in (m for m in a.models if m != "none"):
            with quiet(os.path.join(ROOT, "work_dirs", "sweep", "sweep.log")):
                sweep_detector(model, seed, a.budgets, results, a.results, tuple(a.rows))
    return _finish(results, a.results, t0)


if __name__ == "__main__":
    main()
