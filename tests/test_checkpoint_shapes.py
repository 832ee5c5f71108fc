"""A checkpoint whose keys match but whose tensors have other shapes (another ``num_classes``,
another ``embed_dims``) is refused with one line by every tool that loads one: mmengine would
skip the mismatched tensors with a warning and calibrate a half-random model."""
import os

import pytest
import torch

from tests.conftest import require, tiny_cfg

require("mmdet.models")


def _tiny_state():
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config

    from tests.conftest import TINY_CFG

    register_all_modules()
    torch.manual_seed(0)
    return MODELS.build(Config.fromfile(TINY_CFG).model).state_dict()


def _another_num_classes(state):
    """One more class row in the classifier (weight and bias)."""
    out = dict(state)
    for k in ("bbox_head.fc_cls.weight", "bbox_head.fc_cls.bias"):
        out[k] = torch.cat([state[k], state[k][:1]], dim=0)
    return out


def _another_embed_dims(state, dims=64, to=32):
    """Every width of ``dims`` cut to ``to``: the same keys, the tensors of a narrower model."""
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and dims in v.shape:
            v = v[tuple(slice(0, to) if s == dims else slice(None) for s in v.shape)]
        out[k] = v.clone()
    return out


@pytest.fixture(scope="module")
def bad_checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    state = _tiny_state()
    paths = {}
    for name, make in (("num_classes", _another_num_classes), ("embed_dims", _another_embed_dims)):
        paths[name] = str(d / f"{name}.pth")
        torch.save({"state_dict": make(state), "meta": {}}, paths[name])
    return paths


@pytest.fixture()
def cfg_path(synthetic_data, tmp_path):
    cfg = tiny_cfg(synthetic_data, str(tmp_path / "w"), num_images=2, steps=1)
    path = str(tmp_path / "tiny.py")
    cfg.dump(path)
    return path


def _one_line(exc, path):
    msg = str(exc.value)
    assert path in msg and "\n" not in msg and "of another shape" in msg, msg
    return msg


@pytest.mark.parametrize("kind", ["num_classes", "embed_dims"])
def test_calibrate_tool_refuses_another_shape(bad_checkpoints, cfg_path, tmp_path, kind):
    from latte_plugin.cli import calibrate

    path = bad_checkpoints[kind]
    with pytest.raises(SystemExit) as exc:
        calibrate.main([cfg_path, "--checkpoint", path, "--work-dir", str(tmp_path / "cal")])
    msg = _one_line(exc, path)
    if kind == "num_classes":
        assert "bbox_head.fc_cls" in msg
    assert not os.path.exists(tmp_path / "cal" / "latte_calibrated.pth")


@pytest.mark.parametrize("exact", [False, True], ids=["hybrid", "exact"])
@pytest.mark.parametrize("kind", ["num_classes", "embed_dims"])
def test_export_tool_refuses_another_shape_in_both_modes(bad_checkpoints, cfg_path, tmp_path, kind, exact):
    from latte_plugin.cli import export_onnx

    path = bad_checkpoints[kind]
    with pytest.raises(SystemExit) as exc:
        export_onnx.main([cfg_path, path, "--out", str(tmp_path / "m.onnx")] + (["--exact"] if exact else []))
    _one_line(exc, path)
    assert not os.path.exists(tmp_path / "m.onnx")


@pytest.mark.parametrize("kind", ["num_classes", "embed_dims"])
def test_main_job_refuses_another_shape(bad_checkpoints, cfg_path, tmp_path, kind):
    from experiments import main_job

    path = bad_checkpoints[kind]
    with pytest.raises(SystemExit) as exc:
        main_job.main(["--config", cfg_path, "--checkpoint", path, "--work-dir", str(tmp_path / "mj"),
                       "--rows", "exact"])
    _one_line(exc, path)


def test_the_right_shapes_still_load(cfg_path, tmp_path):
    """The check is not a blanket refusal: the model's own state passes it."""
    from latte_plugin.storage import check_checkpoint
    from mmdet.registry import MODELS
    from mmengine.config import Config

    path = str(tmp_path / "ok.pth")
    torch.save({"state_dict": _tiny_state()}, path)
    torch.manual_seed(0)
    check_checkpoint(MODELS.build(Config.fromfile(cfg_path).model), path)


@pytest.mark.parametrize("kind", ["text", "missing"])
def test_export_tool_says_one_line_for_an_unreadable_checkpoint(cfg_path, tmp_path, kind):
    from latte_plugin.cli import export_onnx

    bad = tmp_path / f"{kind}.pth"
    if kind == "text":
        bad.write_text("not a checkpoint\n")
    with pytest.raises(SystemExit) as exc:
        export_onnx.main([cfg_path, str(bad), "--out", str(tmp_path / "m.onnx")])
    msg = str(exc.value)
    assert str(bad) in msg and "\n" not in msg and msg.startswith("error: ")


def test_the_held_out_layer_mse_of_a_row_is_the_compensated_fit_where_compensation_was_kept():
    from experiments.main_job_rows import row_fits

    plain, comp = {"heldout_mse": 2.0}, {"heldout_mse": 1.0}
    rep = {"fit": {"a": {**plain, "compensated": comp}, "b": dict(plain)},
           "selection": {"compensation": {"kept": True}}}
    assert [f["heldout_mse"] for f in row_fits(rep)] == [1.0, 2.0]  # b was not compensated (exact layer)
    rep["selection"]["compensation"]["kept"] = False
    assert [f["heldout_mse"] for f in row_fits(rep)] == [2.0, 2.0]
