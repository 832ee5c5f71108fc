"""The speed chooser's evidence on the embedded ViT detector at one input size and split
(``docs/results.md#speed``): the main job's rows exact, the paper's protocol, the current defaults
and ``ours:speedup=X`` for several X (calibrated and evaluated with mmdet's CocoMetric), then every
row's assignment timed end to end in fresh processes (``benchmarks/speed_predict.py --from``).

    python -m experiments.speed_job --side 512 --split main
    python -m experiments.speed_job --side 512 --split seed1111 --data-root data/synthetic_512_2key_seed1111
    python -m experiments.speed_job --side 1024 --split main --data-root data/synthetic_1024_2key

Without ``--speedups``, the targets are 30%, 60% and 90% of the way from 1x to the largest
speed-up the architecture's cost model offers at that size (measured here first, before any
calibration: no accuracy figure picks them). The job file keeps them (``speedup_targets``), so a
job split over several sessions keeps its targets.

At 1,440 px a calibration takes about half an hour here, so ``--rows`` runs part of the job: the
rows named are calibrated and evaluated and written into the job file beside the rows already
there (``main_job --update``); the end-to-end timing runs once every row is in the file.

    python -m experiments.speed_job --side 1440 --split main --data-root data/synthetic_1440_2key --rows exact latte
    python -m experiments.speed_job --side 1440 --split main --data-root data/synthetic_1440_2key --rows ours:auto
"""
from __future__ import annotations

import argparse
import os

CONFIG = "configs/mmdet/embedded/deimv2_vit6_synthetic_latte.py"
CHECKPOINT = "checkpoints/deimv2_vit6_synthetic.pth"
#: The 512-1,024 px fine-tune (checkpoints/README.md): the weights for sides above 512, where the
#: 512 px weights lose their own accuracy.
MULTISCALE_CHECKPOINT = "checkpoints/deimv2_vit6_multiscale.pth"
#: Its fourth stage at 1,024-1,440 px: the weights for sides above 1,024 (the 512-1,024 px weights
#: keep bbox mAP 0.264 at 1,440 px, these 0.956).
CHECKPOINT_1440 = "checkpoints/deimv2_vit6_multiscale_1440.pth"
HF_CONFIG = "configs/hf/deimv2_vit6_synthetic.json"
FRACTIONS = (0.3, 0.6, 0.9)


def default_checkpoint(side: int) -> str:
    """The embedded ViT weights trained at ``side``: 512 px, the 512-1,024 px fine-tune, or its
    1,024-1,440 px stage (checkpoints/README.md)."""
    return CHECKPOINT if side <= 512 else MULTISCALE_CHECKPOINT if side <= 1024 else CHECKPOINT_1440


def targets(side: int, threads: int) -> list[str]:
    """Speed-ups spread up to the largest the cost model offers at ``side`` (two decimals)."""
    from benchmarks.speed_predict import cost_model

    cost = cost_model("deimv2", side, threads, HF_CONFIG)
    top = cost.predicted_speedup(cost.fastest())
    print(f"[speed] {side} px: the cost model offers up to {top:.2f}x", flush=True)
    return [f"{1.0 + f * (top - 1.0):.2f}" for f in FRACTIONS]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=int, default=512, help="square input side (the pipelines' Resize)")
    p.add_argument("--split", default="main", help="the split's name in the results files (main, seed1111, ...)")
    p.add_argument("--data-root", default="data/synthetic_512_2key", help="the generated split")
    p.add_argument("--checkpoint", help=f"the weights (default: {CHECKPOINT} at 512 px, "
                                         f"{MULTISCALE_CHECKPOINT} up to 1,024 px, {CHECKPOINT_1440} above)")
    p.add_argument("--speedups", nargs="+", help="speed-up targets (default: spread over the front, see above)")
    p.add_argument("--num-images", type=int, default=None, help="calibration images (default: the config's)")
    p.add_argument("--reps", type=int, default=5, help="timed passes per fresh process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--rows", nargs="+", help="run only these of the job's rows (exact, latte, ours:auto, "
                                             "ours:speedup=X); the others already in the job file are kept")
    a = p.parse_args(argv)
    from benchmarks import speed_predict
    from experiments import main_job
    from latte_plugin.storage import atomic_write_json, read_json

    suffix = f"{a.side}" + ("" if a.split == "main" else f"_{a.split}")
    job_file = os.path.join(a.results_dir, f"speed_deimv2_vit_{suffix}.json")
    job = read_json(job_file, missing={})
    speedups = a.speedups or job.get("speedup_targets") or targets(a.side, a.threads)
    rows = ["exact", "latte", "ours:auto", *(f"ours:speedup={s}" for s in speedups)]
    unknown = [r for r in a.rows or [] if r not in rows]
    if unknown:
        raise SystemExit(f"--rows: {unknown[0]!r} is not a row of this job; its rows: {' '.join(rows)}")
    update = bool(a.rows) and bool(job)
    checkpoint = a.checkpoint or default_checkpoint(a.side)
    main_job.main(["--config", CONFIG, "--checkpoint", checkpoint, "--data-root", a.data_root, "--input-size",
                   str(a.side), "--work-dir", f"work_dirs/speed/{suffix}", "--results", job_file, "--timing-reps", "3",
                   *(["--num-images", str(a.num_images)] if a.num_images else []), "--rows", *(a.rows or rows),
                   *(["--update"] if update else [])])
    job = read_json(job_file, missing={})
    atomic_write_json({**job, "speedup_targets": list(speedups)}, job_file)
    missing = [r for r in rows if r not in job.get("metrics", {})]
    if missing:
        print(f"[speed] {job_file}: rows still to run: {' '.join(missing)} (--rows ...); the end-to-end timing "
              f"runs once every row is there", flush=True)
        return {"missing": missing}
    return speed_predict.main(["--family", "deimv2", "--hf-config", HF_CONFIG, "--sizes", str(a.side), "--from", job_file,
                               "--label", f"ViT DEIMv2 ({a.split})", "--reps", str(a.reps), "--threads", str(a.threads),
                               "--json", os.path.join(a.results_dir, f"speed_measured_deimv2_vit_{suffix}.json")])


if __name__ == "__main__":
    main()
