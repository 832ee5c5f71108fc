"""Bad input as a new user gives it: one line that names the path or the setting, no traceback,
and nothing silently changed (a budget larger than the split is said, and the report records
the number used)."""
import json

import pytest
import torch

import latte_plugin
from tests.conftest import require, tiny_cfg
from tests.toy import ToyEncoder, toy_batches


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value.code if isinstance(exc.value, SystemExit) else exc.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_calibrate_tool_on_a_config_that_does_not_exist(tmp_path):
    from latte_plugin.cli import calibrate

    with pytest.raises(SystemExit) as e:
        calibrate.main([str(tmp_path / "nope.py")])
    assert _one_line(e).startswith(f"error: {tmp_path / 'nope.py'}: no such config file")


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_hf_family_config_whose_pretrained_directory_is_missing_or_empty(tmp_path, make):
    require("mmdet")
    require("transformers")
    from latte_plugin.cli import calibrate

    pretrained = tmp_path / "weights"
    if make == "empty":
        pretrained.mkdir()
    with pytest.raises(SystemExit) as e:
        calibrate.main(["configs/mmdet/hf_rt_detr_r18vd_latte_coco.py", "--work-dir", str(tmp_path / "w"),
                        "--cfg-options", f"model.pretrained={pretrained}"])
    msg = _one_line(e)
    assert str(pretrained) in msg and "not an HF checkpoint directory" in msg, msg


def test_a_budget_larger_than_the_data_is_said_and_recorded():
    lines = []
    model = ToyEncoder(depth=2).eval()
    _, report = latte_plugin.linearize(model, toy_batches(n=4), candidates=["layers.*.attn"], num_images=100000,
                                       steps=2, signal=False, log=lines.append, progress=False)
    said = [line for line in lines if "num_images=100000" in line]
    assert len(said) == 1 and "holds 4" in said[0], lines
    assert report["config"]["num_images"] == 4


def test_the_calibrate_tool_says_a_budget_larger_than_the_split(synthetic_data, tmp_path, capfd):
    """tools/calibrate.py --num-images 100000 on the 8-image train split: one line on the terminal,
    and the report's config holds 8."""
    require("mmdet")
    from latte_plugin.cli import calibrate

    cfg = tiny_cfg(synthetic_data, str(tmp_path / "cal"), steps=2, signal=False, selection="score", correction="sigma")
    cfg.dump(str(tmp_path / "tiny.py"))
    out = calibrate.main([str(tmp_path / "tiny.py"), "--num-images", "100000", "--work-dir", str(tmp_path / "cal")])
    err = capfd.readouterr().err
    assert err.count("num_images=100000, but the calibration data holds 8") == 1, err
    assert json.load(open(out["paths"]["report"]))["config"]["num_images"] == 8
    assert torch.load(out["paths"]["checkpoint"], weights_only=True)
