"""``tools/cpu_env.sh`` and ``benchmarks/allocator.py`` (which measures it): the settings keep a
value the user set, and the benchmark's summary reports what its runs measured, including a
run whose outputs differ."""
import os
import subprocess

from tests.conftest import ROOT

from benchmarks import allocator

VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _sourced(env: dict) -> list[str]:
    cmd = "source tools/cpu_env.sh && echo $MALLOC_MMAP_THRESHOLD_ $MALLOC_TRIM_THRESHOLD_"
    out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_cpu_env_raises_both_thresholds_and_keeps_a_value_already_set():
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    assert _sourced(base) == [str(1 << 40)] * 2
    assert _sourced({**base, "MALLOC_MMAP_THRESHOLD_": "65536"}) == ["65536", str(1 << 40)]


def test_the_scripts_that_run_models_source_it():
    for script in ("tools/demo.sh", "tools/test.sh"):
        with open(os.path.join(ROOT, script), encoding="utf-8") as f:
            assert "source tools/cpu_env.sh" in f.read(), script


def _run(seconds: float, rss: float, scores: list) -> dict:
    return {"seconds_per_image": seconds, "system_seconds_per_image": seconds / 10, "peak_rss_gib": rss,
            "images": 8, "top_scores": scores}


def test_the_allocator_summary_takes_medians_ratios_and_compares_outputs():
    default, tuned = allocator.SETTINGS
    runs = {default: [_run(s, 1.0, [0.9, 0.5]) for s in (0.30, 0.20, 0.25)],
            tuned: [_run(s, 1.2, [0.9, 0.5]) for s in (0.10, 0.40, 0.20)]}
    out = allocator.summarise(runs)
    assert out["median"][default]["seconds_per_image"] == 0.25 and out["median"][tuned]["seconds_per_image"] == 0.20
    assert abs(out["speedup"] - 1.25) < 1e-12 and abs(out["rss_ratio"] - 1.2) < 1e-12
    assert out["same_outputs"] is True
    runs[tuned][1]["top_scores"] = [0.9, 0.4]
    assert allocator.summarise(runs)["same_outputs"] is False
