"""benchmarks/family_speed.py's JSON shape at a tiny size (not a timed test: no figure is checked)."""
import importlib.util
import os

from tests.conftest import ROOT, require

require("transformers")


def test_family_speed_rows_have_every_setting_and_their_fields(tmp_path):
    # loaded from its file: putting benchmarks/ on sys.path would let benchmarks/onnx.py shadow the onnx package
    spec = importlib.util.spec_from_file_location("family_speed", os.path.join(ROOT, "benchmarks", "family_speed.py"))
    family_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(family_speed)

    out = family_speed.main(["--family", "rt_detr", "--sizes", "128", "--reps", "1", "--threads", "1",
                             "--json", str(tmp_path / "speed.json"), "--plot", str(tmp_path / "speed.png")])
    assert [r["setting"] for r in out["rows"]] == list(family_speed.SETTINGS)
    for r in out["rows"]:
        assert {"side", "tokens", "seconds", "runs", "attention_share", "peak_rss_gib", "linear", "candidates"} <= set(r)
        assert 0.0 <= r["attention_share"] < 1.0 and r["seconds"] > 0 and len(r["runs"]) == 1
    assert [r["linear"] for r in out["rows"]] == [0, 3, 3]  # 67% and 83% of RT-DETR-R18's 4 candidates
    assert os.path.getsize(tmp_path / "speed.png") > 0 and os.path.isfile(tmp_path / "speed.json")
