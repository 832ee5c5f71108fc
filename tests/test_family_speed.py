"""benchmarks/family_speed.py's JSON shape at a tiny size (not a timed test: no figure is checked)."""
import os

from tests.conftest import ROOT, require

require("transformers")


def _family_speed():
    from benchmarks import family_speed
    return family_speed


def test_family_speed_takes_another_architecture_the_calibrated_linear_sets_and_writes_every_field(tmp_path):
    import json

    from latte_plugin.hf.detectors import build_detector
    from latte_plugin.hf.discovery import detector_sites

    family_speed = _family_speed()
    arch = os.path.join(ROOT, "configs", "hf", "deimv2_vit6_synthetic.json")
    names = [s.name for s in detector_sites(build_detector("deimv2", arch).eval(), (128, 128)) if s.candidate]
    assert len(names) == 10  # 6 ViT blocks, AIFI, 3 decoder self-attention
    # a main job's results as mmdet's HFDetector names them ("hf." + the HF module's name)
    chosen = {"ours:auto": ["hf." + n for n in names[-2:]], "ours:auto@83%": ["hf." + n for n in names[:3]]}
    main_job = tmp_path / "main_job.json"
    main_job.write_text(json.dumps({"rows": {row: {"linearized": lin} for row, lin in chosen.items()}}))
    out = family_speed.main(["--family", "deimv2", "--hf-config", arch, "--linear-from", str(main_job), "--label", "vit",
                             "--sizes", "128", "--reps", "1", "--threads", "1", "--settings", "exact", "67%",
                             "--json", str(tmp_path / "speed.json"),
                             "--plot", str(tmp_path / "speed.png")])
    assert [(r["setting"], r["linear"], r["candidates"], r["model"], r["kernel"]) for r in out["rows"]] == [
        ("exact", 0, 10, "vit", "eager"), ("67%", 2, 10, "vit", "eager")]
    for r in out["rows"]:  # every field, one timed run each; the kernel: the default eager fused path
        assert {"side", "tokens", "seconds", "runs", "attention_share", "peak_rss_gib", "linear", "candidates"} <= set(r)
        assert 0.0 <= r["attention_share"] < 1.0 and r["seconds"] > 0 and len(r["runs"]) == 1
    assert os.path.getsize(tmp_path / "speed.png") > 0 and os.path.isfile(tmp_path / "speed.json")
    assert family_speed.calibrated_linear(str(main_job), "67%") == names[-2:]
    assert family_speed.calibrated_linear(str(main_job), "83%") == names[:3]  # the row not timed: one process less


def test_family_speed_runs_mmdets_detr_r50():
    require("mmdet")
    out = _family_speed().main(["--family", "detr_r50", "--sizes", "128", "--reps", "1", "--threads", "1",
                                "--settings", "83%"])  # one child process: the exact row is the same build, unswapped
    assert [(r["setting"], r["linear"], r["candidates"], r["tokens"]) for r in out["rows"]] == [("83%", 5, 6, 16)]
