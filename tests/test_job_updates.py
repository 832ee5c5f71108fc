"""Jobs split over several runs: ``main_job --update`` and ``speed_job --rows`` (no calibration)."""
import json

import pytest


def test_an_update_without_the_exact_row_keeps_the_share_against_the_files_exact(tmp_path):
    from experiments.main_job import updated

    path = tmp_path / "job.json"
    path.write_text(json.dumps({"default_row": "ours:auto", "choices": {},
                                "rows": {"exact": {"kind": "exact"}, "latte": {"kind": "latte"}},
                                "metrics": {"exact": {"bbox_mAP": 0.8, "retained": 1.0},
                                            "latte": {"bbox_mAP": 0.4, "retained": 0.5}}}))
    new = {"command": "python -m experiments.main_job --rows ours:auto", "rows": {"ours:auto": {"kind": "ours"}},
           "metrics": {"ours:auto": {"bbox_mAP": 0.76, "retained": float("nan")}}, "choices": {"ours:auto": {}}}
    out = updated(new, str(path))
    assert out["metrics"]["ours:auto"]["retained"] == pytest.approx(0.95)
    assert out["metrics"]["latte"]["retained"] == pytest.approx(0.5)
    assert list(out["rows"]) == ["exact", "latte", "ours:auto"]
    assert out["retained"] == pytest.approx(0.95)
    assert out["updates"][-1]["rows"] == ["ours:auto"]


def test_an_update_that_refuses_a_row_drops_the_rows_earlier_choice(tmp_path):
    """A ``speedup=`` row calibrated before and refused now (no choice in the new run) must not keep
    the old run's assignment: the speed job times every choice in the file."""
    from experiments.main_job import updated

    path = tmp_path / "job.json"
    path.write_text(json.dumps({"choices": {"ours:speedup=2": {"linearized": ["a"]}, "latte": {"linearized": ["b"]}},
                                "metrics": {"ours:speedup=2": {"bbox_mAP": 0.5}, "latte": {"bbox_mAP": 0.4}}}))
    new = {"command": "main_job --rows ours:speedup=2", "rows": {}, "choices": {},
           "metrics": {"ours:speedup=2": {"bbox_mAP": float("nan"), "refused": "speedup=2 is above ..."}}}
    out = updated(new, str(path))
    assert list(out["choices"]) == ["latte"] and out["metrics"]["ours:speedup=2"]["refused"]


def test_the_speed_job_refuses_a_row_it_does_not_have(tmp_path):
    from experiments import speed_job

    with pytest.raises(SystemExit, match="'ours:speedup=9' is not a row of this job"):
        speed_job.main(["--side", "1440", "--speedups", "1.5", "2", "--rows", "exact", "ours:speedup=9",
                        "--results-dir", str(tmp_path)])


def test_the_speed_job_takes_the_weights_trained_at_its_size():
    """512 px: the 512 px weights; up to 1,024 px: the 512-1,024 px fine-tune; above: its 1,440 px
    stage. Each is a committed file."""
    import os

    from experiments import speed_job
    from tests.conftest import ROOT

    picks = {side: speed_job.default_checkpoint(side) for side in (512, 736, 1024, 1440)}
    assert picks == {512: speed_job.CHECKPOINT, 736: speed_job.MULTISCALE_CHECKPOINT,
                     1024: speed_job.MULTISCALE_CHECKPOINT, 1440: speed_job.CHECKPOINT_1440}
    assert all(os.path.isfile(os.path.join(ROOT, p)) for p in picks.values())


def test_a_size_whose_job_is_in_progress_reads_not_timed_rather_than_missed():
    from experiments.readme_tables_speed import vit_goals

    def point(row, kept, measured, mAP=0.95):
        return {"side": 1440, "split": "main", "row": row, "kept": kept, "measured": measured, "mAP": mAP}

    line = vit_goals([point("exact", 1.0, 1.0), point("latte", 0.62, None)])
    assert "1440 px (8,101 tokens): not timed yet" in line and "paper protocol (67%, score, sigma) 62.0% kept" in line
    assert "missed" not in line.split("1440 px")[1]
    timed = vit_goals([point("exact", 1.0, 1.0), point("latte", 0.62, 1.9), point("ours:speedup=3", 0.98, 3.6)])
    assert "goal >= 97% kept at >= 3.5x: met (fastest measured at >= 97% kept: main 3.60x)" in timed
    weak = vit_goals([point("exact", 1.0, 1.0, mAP=0.264), point("latte", 1.31, None, mAP=0.346)])
    assert "holds only bbox mAP main 0.264 here (bar 0.9)" in weak
    assert "holds only" not in line


def test_the_calibrations_own_prediction_is_judged_against_the_same_measurements():
    """The README names the largest error of the report's ``predicted_speedup`` beside the benchmark's;
    rows without a calibration prediction (exact) or not timed yet are left out."""
    from experiments.readme_tables_speed import calibration_error

    def point(row, predicted, measured):
        return {"side": 1440, "split": "main", "row": row, "predicted_calibration": predicted, "measured": measured}

    points = [point("exact", None, 1.0), point("ours:speedup=1.78", 1.84, 2.0), point("ours:speedup=2.56", 2.7, 3.0),
              point("ours:speedup=3", 2.9, None)]
    err, where, count = calibration_error(points)
    assert err == pytest.approx(0.1) and where == "1440 px main ours:speedup=2.56" and count == 2
    assert calibration_error([point("exact", None, 1.0)]) is None
    points[1]["anchored"] = True  # the rows whose cost model was scaled to an end-to-end timing, apart
    assert calibration_error(points, anchored=True) == (pytest.approx(0.08), "1440 px main ours:speedup=1.78", 1)
    assert calibration_error(points, anchored=False)[1:] == ("1440 px main ours:speedup=2.56", 1)
