"""The speed chooser's evidence on the embedded ViT detector at one input size and split
(``docs/results.md#speed``): the main job's rows exact, the paper's protocol, the current defaults
and ``ours:speedup=X`` for several X (calibrated and evaluated with mmdet's CocoMetric), then every
row's assignment timed end to end in fresh processes (``benchmarks/speed_predict.py --from``).

    python -m experiments.speed_job --side 512 --split main
    python -m experiments.speed_job --side 512 --split seed1111 --data-root data/synthetic_512_2key_seed1111
    python -m experiments.speed_job --side 1024 --split main --data-root data/synthetic_1024_2key

Without ``--speedups``, the targets are 30%, 60% and 90% of the way from 1x to the largest
speed-up the architecture's cost model offers at that size (measured here first, before any
calibration: no accuracy figure picks them).
"""
from __future__ import annotations

import argparse
import os

CONFIG = "configs/mmdet/embedded/deimv2_vit6_synthetic_latte.py"
CHECKPOINT = "checkpoints/deimv2_vit6_synthetic.pth"
#: The 512-1,024 px fine-tune (checkpoints/README.md): the weights for sides above 512, where the
#: 512 px weights lose their own accuracy.
MULTISCALE_CHECKPOINT = "checkpoints/deimv2_vit6_multiscale.pth"
HF_CONFIG = "configs/hf/deimv2_vit6_synthetic.json"
FRACTIONS = (0.3, 0.6, 0.9)


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
                                         f"{MULTISCALE_CHECKPOINT} above)")
    p.add_argument("--speedups", nargs="+", help="speed-up targets (default: spread over the front, see above)")
    p.add_argument("--num-images", type=int, default=None, help="calibration images (default: the config's)")
    p.add_argument("--reps", type=int, default=5, help="timed passes per fresh process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", default="results")
    a = p.parse_args(argv)
    from benchmarks import speed_predict
    from experiments import main_job

    suffix = f"{a.side}" + ("" if a.split == "main" else f"_{a.split}")
    speedups = a.speedups or targets(a.side, a.threads)
    job_file = os.path.join(a.results_dir, f"speed_deimv2_vit_{suffix}.json")
    rows = ["exact", "latte", "ours:auto", *(f"ours:speedup={s}" for s in speedups)]
    checkpoint = a.checkpoint or (CHECKPOINT if a.side <= 512 else MULTISCALE_CHECKPOINT)
    main_job.main(["--config", CONFIG, "--checkpoint", checkpoint, "--data-root", a.data_root, "--input-size",
                   str(a.side), "--work-dir", f"work_dirs/speed/{suffix}", "--results", job_file, "--timing-reps", "3",
                   *(["--num-images", str(a.num_images)] if a.num_images else []), "--rows", *rows])
    return speed_predict.main(["--family", "deimv2", "--hf-config", HF_CONFIG, "--sizes", str(a.side), "--from", job_file,
                               "--label", f"ViT DEIMv2 ({a.split})", "--reps", str(a.reps), "--threads", str(a.threads),
                               "--json", os.path.join(a.results_dir, f"speed_measured_deimv2_vit_{suffix}.json")])


if __name__ == "__main__":
    main()
