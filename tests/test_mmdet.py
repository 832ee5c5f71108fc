"""The MMDetection path: drop-in attention, config-driven swap, the hook in a real Runner,
tools/calibrate.py with CocoMetric, and reloading a calibrated checkpoint."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import PAPER, ROOT, require, tiny_cfg

require("mmcv.ops")
require("mmdet.models")
import latte_plugin.mmdet  # noqa: E402,F401  (registers LATTEAttention / LinearizeHook)
from latte_plugin.nn.install import find_latte_layers, set_modes


def _build(cfg_model):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    register_all_modules()
    torch.manual_seed(0)
    return MODELS.build(copy.deepcopy(cfg_model)).eval()


@pytest.mark.parametrize("batch_first", [True, False])
def test_latte_attention_is_a_drop_in_for_mmcv(batch_first):
    from mmcv.cnn.bricks.transformer import MultiheadAttention
    from mmdet.registry import MODELS

    ref = MultiheadAttention(64, 4, batch_first=batch_first).eval()
    lat = MODELS.build(dict(type="LATTEAttention", embed_dims=64, num_heads=4, batch_first=batch_first)).eval()
    missing, unexpected = lat.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(".latte." in k for k in missing)  # checkpoint loads unchanged
    shape = (2, 30, 64) if batch_first else (30, 2, 64)
    x, pos = torch.randn(shape), torch.randn(shape)
    kpm = torch.zeros(2, 30, dtype=torch.bool)
    kpm[1, 20:] = True
    with torch.no_grad():
        a = ref(x, query_pos=pos, key_padding_mask=kpm)
        b = lat(x, query_pos=pos, key_padding_mask=kpm)
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
        lat.latte.register_forward_hook(lambda *args: None)  # a tap forces our own exact path
        torch.testing.assert_close(lat(x, query_pos=pos, key_padding_mask=kpm), a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("base", [
    "mmdet::detr/detr_r50_8xb2-150e_coco.py",
    "mmdet::conditional_detr/conditional-detr_r50_8xb2-50e_coco.py",
    "mmdet::dab_detr/dab-detr_r50_8xb2-50e_coco.py",
])
def test_config_swap_on_detr_family(base):
    from mmengine.config import Config

    from latte_plugin.calibration.config import LatteConfig
    from latte_plugin.mmdet import install_latte_cores

    import mmdet

    cfg = Config.fromfile(os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", base.split("::")[1]))
    cfg.model.backbone.init_cfg = None
    model = _build(cfg.model)
    x = torch.randn(1, 3, 96, 128)
    from mmdet.structures import DetDataSample

    ds = DetDataSample(metainfo=dict(img_shape=(96, 128), batch_input_shape=(96, 128), pad_shape=(96, 128)))
    with torch.no_grad():
        before = model(x, [ds], mode="tensor")
        names = install_latte_cores(model, LatteConfig(candidates=["encoder.layers.*.self_attn"]))
        assert names == [f"encoder.layers.{i}.self_attn" for i in range(6)]
        after = model(x, [ds], mode="tensor")
        for a, b in zip(before, after):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        set_modes(find_latte_layers(model), names)
        lin = model(x, [ds], mode="tensor")
    assert not torch.allclose(lin[0], before[0])


def test_hook_calibrates_inside_a_real_runner(synthetic_data, tmp_path):
    from mmengine.runner import Runner

    cfg = tiny_cfg(synthetic_data, str(tmp_path), num_images=4, steps=20)
    runner = Runner.from_cfg(cfg)
    metrics = runner.test()
    assert "coco/bbox_mAP" in metrics and 0.0 <= metrics["coco/bbox_mAP"] <= 1.0
    layers = find_latte_layers(runner.model)
    assert len(layers) == 6 and all(bool(l.calibrated) for l in layers.values())
    assert sum(l.mode == "linear" for l in layers.values()) == 4
    report = json.load(open(tmp_path / "latte_report.json"))
    assert sorted(report["linearized"]) == sorted(n for n, l in layers.items() if l.mode == "linear")


def test_calibrate_tool_eval_and_checkpoint_reload(synthetic_data, tmp_path):
    from mmengine.runner import Runner

    from latte_plugin.mmdet.workflow import run_calibration

    cfg = tiny_cfg(synthetic_data, str(tmp_path / "cal"), num_images=4, steps=20)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    report = run_calibration(str(cfg_path), work_dir=str(tmp_path / "cal"), evaluate=True,
                             overrides=dict(ratio=0.5))
    saved = json.load(open(report["paths"]["report"]))
    for key in ("variant", "candidates", "sensitivity", "linearized", "params", "metrics", "retained",
                "attention_gflops"):
        assert key in saved, key
    assert set(saved["metrics"]) == {"exact", "linearized"}
    assert set(saved["metrics"]["exact"]) == {"bbox_mAP", "bbox_mAP_50"}
    assert len(saved["linearized"]) == 3
    assert set(saved["params"][saved["candidates"][0]]) == {"alpha", "delta_q", "delta_k", "beta_q", "beta_k"}
    assert saved["attention_gflops"]["linearized"] < saved["attention_gflops"]["exact"]
    ckpt = torch.load(report["paths"]["checkpoint"], weights_only=True)  # no pickled code
    assert any(k.endswith("attn.latte.m") for k in ckpt["state_dict"])

    # A fresh Runner on the same config + calibrated checkpoint restores the hybrid without recalibrating.
    cfg2 = tiny_cfg(synthetic_data, str(tmp_path / "reload"), calibrate="never")
    cfg2.load_from = report["paths"]["checkpoint"]
    runner = Runner.from_cfg(cfg2)
    metrics = runner.test()
    assert not os.path.exists(tmp_path / "reload" / "latte_report.json")  # no recalibration happened
    layers = find_latte_layers(runner.model)
    assert sorted(n for n, l in layers.items() if l.mode == "linear") == sorted(saved["linearized"])
    assert metrics["coco/bbox_mAP"] == pytest.approx(saved["metrics"]["linearized"]["bbox_mAP"], abs=1e-9)


def test_the_tools_config_text_skips_yapf_and_still_loads_as_the_same_config(tmp_path, monkeypatch):
    """load_config switches off mmengine's yapf pass (seconds per Runner): its text is made without
    calling yapf, and that text loads back as the same config."""
    from mmengine.config import Config
    from mmengine.config import config as mm_config

    from tests.conftest import TINY_CFG
    from latte_plugin.mmdet.workflow import load_config

    def refuse(*args, **kwargs):
        raise AssertionError("yapf was called")

    monkeypatch.setattr(mm_config, "FormatCode", refuse)
    cfg = load_config(TINY_CFG, ["model.num_queries=7"])
    (tmp_path / "dumped.py").write_text(cfg.pretty_text)
    back = Config.fromfile(str(tmp_path / "dumped.py"))
    assert back.model.num_queries == 7 and back.to_dict() == cfg.to_dict()


def test_the_tools_runner_stops_its_evaluation_workers_with_each_loop(synthetic_data, tmp_path):
    """runner_with_checkpoint (every tool's Runner) builds the evaluation loaders without
    persistent workers: mmdet's COCO base asks for them, and collected inside a Python process
    their shutdown waited 10 s (5 s per worker). Other loader settings are the config's."""
    from latte_plugin.mmdet.workflow import runner_with_checkpoint

    cfg = tiny_cfg(synthetic_data, str(tmp_path), calibrate="never")
    for key in ("val_dataloader", "test_dataloader"):
        cfg[key].update(num_workers=1, persistent_workers=True)
    runner = runner_with_checkpoint(cfg, None)
    for key in ("val_dataloader", "test_dataloader"):
        assert runner.cfg[key].persistent_workers is False and runner.cfg[key].num_workers == 1
    assert runner.test_dataloader.persistent_workers is False
    assert runner.cfg.train_dataloader.persistent_workers == tiny_cfg(None, None).train_dataloader.persistent_workers


def test_input_size_calibrates_times_and_evaluates_at_the_deployment_size(synthetic_data, tmp_path, monkeypatch):
    """input_size=96 on the tiny DETR (its test pipeline: 256 px): the calibration images come at
    96 x 96, the cost model is timed on the encoder's 6 x 6 tokens (stride 16) instead of 16 x 16, and
    the tool's evaluation runs at 96 px too; a pipeline without a Resize is named."""
    from latte_plugin.mmdet import workflow
    from latte_plugin.mmdet.calibrate import build_calibration_loader, resize_pipeline

    cfg = tiny_cfg(synthetic_data, str(tmp_path))
    assert next(iter(build_calibration_loader(cfg)))["inputs"][0].shape[-2:] == (256, 256)
    assert next(iter(build_calibration_loader(cfg, input_size=(96, 96))))["inputs"][0].shape[-2:] == (96, 96)
    cfg.dump(str(tmp_path / "tiny.py"))
    scales = []
    monkeypatch.setattr(workflow, "evaluate_bbox", lambda runner, linear, mode: scales.append(
        next(t["scale"] for t in runner.cfg.test_dataloader.dataset.pipeline if t["type"] == "Resize"))
        or {"bbox_mAP": 0.5, "bbox_mAP_50": 0.5})
    report = workflow.run_calibration(str(tmp_path / "tiny.py"), work_dir=str(tmp_path / "w"), evaluate=True,
                                      overrides=dict(input_size=[96], num_images=2, steps=1, speedup=1.0, **PAPER))
    assert {tuple(s) for s in scales} == {(96, 96)}
    shapes = report["speed"]["cost"]["shapes"]
    assert shapes and all(keys == 36 for calls in shapes.values() for _, _, _, keys, _ in calls)
    with pytest.raises(ValueError, match="input_size: the test pipeline has no Resize"):
        resize_pipeline([dict(type="LoadImageFromFile")], (96, 96), "the test pipeline")


def test_never_calibrate_without_latte_state_is_a_clear_error(synthetic_data, tmp_path):
    from mmengine.runner import Runner

    runner = Runner.from_cfg(tiny_cfg(synthetic_data, str(tmp_path), calibrate="never"))
    with pytest.raises(ValueError, match="no calibrated LATTE state"):
        runner.test()


def _piecewise_only_costs(layers, batch, forward, knobs, modes=None):
    """A cost model where only the piecewise kernel saves time (LATTE is slower than softmax)."""
    from latte_plugin.calibration.cost import CostModel

    return CostModel(40.0, {n: {"exact": 5.0, "latte": 6.0, "piecewise@1": 2.0, "piecewise@2": 3.0} for n in layers})


def test_mmdet_tools_test_reproduces_linearized_map(synthetic_data, tmp_path, monkeypatch):
    """mmdet's own tools/test.py on a checkpoint calibrated with speedup= prints the linearized
    bbox_mAP: the checkpoint carries the per-layer assignment (which layers run, each with its
    piecewise knobs: blocks of 4 of the encoder's 16 tokens; the cost model is a fixed one where
    only the piecewise kernel saves time)."""
    import mmdet

    from latte_plugin.calibration import flow
    from latte_plugin.mmdet.workflow import run_calibration

    monkeypatch.setattr(flow, "measure_costs", _piecewise_only_costs)
    cfg = tiny_cfg(synthetic_data, str(tmp_path / "cal"), num_images=4, steps=5, speedup=1.3, piecewise_block=4,
                   correction="sigma", signal=False)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    report = run_calibration(str(cfg_path), work_dir=str(tmp_path / "cal"), evaluate=True)
    assignment = report["speed"]["assignment"]
    assert report["speed"]["predicted_speedup"] >= 1.3 and os.path.isfile(report["paths"]["speed_front_plot"])
    state = torch.load(report["paths"]["checkpoint"], weights_only=True)["state_dict"]
    for name in report["candidates"]:
        mode = assignment.get(name)
        assert int(state[f"{name}.attn.latte.mode_id"]) == (0 if mode is None else 1), name
        if mode is not None:
            assert int(state[f"{name}.attn.latte.kernel_id"]) == 1
            assert f"piecewise@{int(state[f'{name}.attn.latte.piecewise_top'])}" == mode
    test_py = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "tools", "test.py")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, test_py, str(cfg_path), report["paths"]["checkpoint"],
                          "--work-dir", str(tmp_path / "t")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "using the calibrated LATTE state" in text
    expect = f"coco/bbox_mAP: {report['metrics']['linearized']['bbox_mAP']:.4f}"
    assert expect in text, text[-2000:]


def test_main_job_rows_on_tiny_config(synthetic_data, tmp_path, monkeypatch):
    from experiments import main_job

    from latte_plugin.calibration import flow

    measured = []  # the signal is the exact model's: the job measures it once, not per row
    monkeypatch.setattr(flow, "attention_signal", lambda *a, _f=flow.attention_signal: measured.append(1) or _f(*a))

    cfg = tiny_cfg(synthetic_data, str(tmp_path), num_images=4, steps=3)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    report = main_job.main(["--config", str(cfg_path), "--checkpoint", "none", "--work-dir", str(tmp_path / "job"),
                            "--rows", "exact", "uniform", "latte", "ours:greedy@83%", "ours:speedup=1.0", "ours:speedup=99",
                            "--timing-reps", "1", "--results", str(tmp_path / "results.json")])
    m = report["metrics"]
    # speed rows: one chooses modes (1x is always reachable), one is refused in its row, not the job
    assert m["ours:speedup=1.0"]["predicted_speedup"] >= 1.0 and m["ours:speedup=1.0"]["measured_speedup"] > 0
    assert "largest predicted end-to-end speed-up" in m["ours:speedup=99"]["refused"]
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["choices"]["ours:speedup=1.0"]["speed"]["front"] and "ours:speedup=99" not in saved["choices"]
    m = {k: v for k, v in m.items() if not k.startswith("ours:speedup=")}
    assert set(m) >= {"exact", "uniform", "latte", "ours:greedy@83%", "linearized"}
    assert m["uniform"]["linear"] == "6/6" and m["latte"]["linear"] == "4/6" and m["ours:greedy@83%"]["linear"] == "5/6"
    assert m["uniform"]["attention_gflops"] < m["latte"]["attention_gflops"] < m["exact"]["attention_gflops"]
    assert all(r["encoder_latency_ratio"] > 0 for r in m.values())
    # the signal column: the weakest linear layer's signal, from the calibration report's per-layer signal
    assert m["exact"]["weakest_signal"] is None and set(report["signal"]) == set(report["candidates"])
    assert m["uniform"]["weakest_signal"] == min(report["signal"].values())
    assert len(measured) == 1 and m["ours:greedy@83%"]["weakest_signal"] is not None
    for key in ("variant", "candidates", "sensitivity", "linearized", "params", "retained", "attention_gflops"):
        assert key in report
    assert os.path.exists(tmp_path / "job" / "latte_kept.png")
    assert os.path.exists(tmp_path / "job" / "latte_calibrated.pth")


def test_main_job_rows_that_differ_in_share_calibrate_once(synthetic_data, tmp_path):
    """Rows that differ only in their share calibrate once (ours:greedy and ours:greedy@83% here;
    ours:auto and ours:auto@83% in the full job) and each gets the figures its own calibration
    gives; the table keeps the rows' order."""
    from experiments import main_job
    from experiments.main_job_rows import ROWS, shared_calibrations

    from latte_plugin.calibration.config import LatteConfig

    groups = shared_calibrations(LatteConfig(), ROWS)
    assert [r.name for r in groups["ours:auto"]] == ["ours:auto", "ours:auto@83%"]
    assert all(len(g) > 1 for g in groups.values()) and "ours:target=5%" not in str(groups)
    cfg = tiny_cfg(synthetic_data, str(tmp_path), num_images=4, steps=3)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    run = lambda rows, d, *more: main_job.main(["--config", str(cfg_path), "--checkpoint", "none",  # noqa: E731
                                                "--work-dir", str(tmp_path / d), "--rows", *rows, "--timing-reps", "1",
                                                *more])
    both = run(["ours:greedy@83%", "exact", "ours:greedy"], "both")
    alone = run(["ours:greedy@83%"], "alone", "--no-signal")  # the headline's flag: no signal, the same figures
    assert both["signal"] and not alone["signal"] and alone["metrics"]["ours:greedy@83%"]["weakest_signal"] is None
    assert list(both["metrics"])[:3] == ["exact", "ours:greedy", "ours:greedy@83%"]  # ROWS order
    shared, own = both["metrics"]["ours:greedy@83%"], alone["metrics"]["ours:greedy@83%"]
    assert shared["linear"] == own["linear"] == "5/6" and both["metrics"]["ours:greedy"]["linear"] == "4/6"
    for key in ("bbox_mAP", "heldout_distortion", "heldout_fidelity", "heldout_mse"):
        assert (shared[key] is None) == (own[key] is None), key
        assert shared[key] is None or shared[key] == pytest.approx(own[key], rel=1e-9), key
    assert shared["calibration_shared_with"] == "ours:greedy"


def test_runner_saved_checkpoint_loads_with_weights_only(synthetic_data, tmp_path):
    """mmengine 0.10.7 pickles a HistoryBuffer and numpy arrays into every checkpoint it saves;
    torch >= 2.6 loads with weights_only=True by default. Importing latte_plugin.mmdet
    allow-lists exactly those types, so load_from / tools/test.py work without unsafe loading."""
    from mmengine.runner import Runner

    from latte_plugin.mmdet.checkpoint import slim_checkpoint

    cfg = tiny_cfg(synthetic_data, str(tmp_path / "train"))
    cfg.custom_hooks = []
    cfg.train_cfg = dict(type="IterBasedTrainLoop", max_iters=1, val_interval=10)
    cfg.param_scheduler = []
    cfg.default_hooks.checkpoint = dict(type="CheckpointHook", interval=1, by_epoch=False)
    Runner.from_cfg(cfg).train()
    src = str(tmp_path / "train" / "iter_1.pth")
    raw = torch.load(src, weights_only=True)  # would raise "Unsupported global" without the allow-list
    assert "message_hub" in raw and "state_dict" in raw
    meta = slim_checkpoint(src, str(tmp_path / "slim.pth"), dtype=torch.float16)
    slim = torch.load(str(tmp_path / "slim.pth"), weights_only=True)
    assert meta["iter"] == 1 and set(slim) == {"meta", "state_dict", "model"}  # 'model': detectron2's key
    assert all(v.dtype != torch.float32 for v in slim["state_dict"].values())
    assert all(slim["model"][k] is v for k, v in slim["state_dict"].items())  # stored once, shared


def test_restricted_getattr_blocks_everything_but_history_buffer_stats(tmp_path):
    from mmengine.logging.history_buffer import HistoryBuffer

    class Sneaky:
        def __reduce__(self):
            return (getattr, (HistoryBuffer, "__init__"))

    class Fine:
        def __reduce__(self):
            return (getattr, (HistoryBuffer, "mean"))

    torch.save({"x": Fine()}, tmp_path / "fine.pth")
    assert torch.load(tmp_path / "fine.pth", weights_only=True)["x"] is HistoryBuffer.mean
    torch.save({"x": Sneaky()}, tmp_path / "bad.pth")
    with pytest.raises(Exception, match="only HistoryBuffer statistics methods"):
        torch.load(tmp_path / "bad.pth", weights_only=True)


def test_embedded_checkpoint_matches_its_config():
    """The committed embedded checkpoint loads (weights_only) into the embedded config's model, key for key."""
    from mmengine.config import Config

    ckpt_path = os.path.join(ROOT, "checkpoints", "cond_detr_r18_synthetic.pth")
    cfg = Config.fromfile(os.path.join(ROOT, "configs", "mmdet", "embedded", "cond_detr_r18_synthetic_latte.py"))
    model = _build(cfg.model)
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert os.path.getsize(ckpt_path) <= 25 * 2**20
    missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in ckpt["state_dict"].items()}, strict=False)
    assert not missing and not unexpected
    assert ckpt["meta"]["epoch"] == 3


def test_calibrated_checkpoint_from_another_config_is_refused(synthetic_data, tmp_path):
    from mmengine.runner import Runner

    from latte_plugin.mmdet.workflow import run_calibration

    cfg = tiny_cfg(synthetic_data, str(tmp_path / "cal"), num_images=2, steps=5, **PAPER)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    report = run_calibration(str(cfg_path), work_dir=str(tmp_path / "cal"))
    other = tiny_cfg(synthetic_data, str(tmp_path / "other"), candidates=["encoder.layers.[0-2].self_attn"])
    other.load_from = report["paths"]["checkpoint"]
    runner = Runner.from_cfg(other)
    with pytest.raises(ValueError, match="latte_calibrated.pth was calibrated for other LATTE candidates"):
        runner.test()


def _report_core(path):
    rep = json.load(open(path))
    return {k: rep[k] for k in ("candidates", "linearized", "params", "sensitivity", "sigma_mean", "fit", "selection")}


def _latte_state(path):
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if ".latte." in k}


@pytest.mark.timeout(900)
def test_mmengine_distributed_launch_matches_one_process_and_is_deterministic(synthetic_data, tmp_path):
    """tools/calibrate.py under torchrun (2 CPU processes, gloo, mmengine's launcher) on the tiny
    DETR (random weights, 6 encoder layers), batches of 2 images and 7 of 8 train images (7 does
    not divide by 2 ranks or by the batch): the same 7 images (positions per image, not per
    batch), the same selection and every fitted buffer (m, log_rho, sigma, refit weights and
    bias) within 1e-5 as 1 process; two 1-process runs side by side (a fresh process and this one) give
    an identical report and checkpoint.
    The launch is what is tested, so the model is the smallest that has every fitted buffer."""
    # selection by score: the launch is under test, not the choice rule (its judged forwards cost most)
    cfg = tiny_cfg(synthetic_data, str(tmp_path), num_images=7, steps=5, calib_batch_size=2, correction="refit",
                   selection="score")
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    tool = os.path.join(ROOT, "tools", "calibrate.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(work, *launch, extra=()):
        return work, subprocess.Popen([*launch, tool, str(cfg_path), "--work-dir", str(tmp_path / work), *extra],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def result(started):
        work, proc = started
        out, err = proc.communicate()
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
        return _report_core(tmp_path / work / "latte_report.json"), _latte_state(tmp_path / work / "latte_calibrated.pth")

    def run(work, *launch, extra=()):
        return result(start(work, *launch, extra=extra))

    # the two 1-process runs side by side, one thread each: a fresh process, and this one (no second start-up)
    first, threads = start("one", sys.executable), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _calibrate_tool().main([str(cfg_path), "--work-dir", str(tmp_path / "again")])
    finally:
        torch.set_num_threads(threads)
    (one, one_state) = result(first)
    again, again_state = _report_core(tmp_path / "again" / "latte_report.json"), _latte_state(tmp_path / "again" / "latte_calibrated.pth")
    assert json.dumps(one, sort_keys=True) == json.dumps(again, sort_keys=True)  # bit-identical report
    assert all(torch.equal(one_state[k], again_state[k]) for k in one_state)
    two, two_state = run("two", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", extra=("--launcher", "pytorch"))
    assert sum(one["selection"]["images"].values()) == 7 and two["selection"]["images"] == one["selection"]["images"]
    assert two["linearized"] == one["linearized"]
    assert any(k.endswith("refit_weight") and not torch.equal(v, torch.eye(v.shape[0])) for k, v in one_state.items())
    for k, v in one_state.items():
        torch.testing.assert_close(two_state[k], v, atol=1e-5, rtol=0, msg=k)
    for n in one["params"]:
        assert two["fit"][n]["steps"] == one["fit"][n]["steps"] and two["fit"][n]["refit_reg"] == one["fit"][n]["refit_reg"]


def _calibrate_tool():
    from latte_plugin.cli import calibrate

    return calibrate


def test_a_checkpoint_of_another_model_is_refused(synthetic_data, tmp_path):
    """The issue's case: the RT-DETR checkpoint given to the DETR config stops the run with one
    line (counts and examples of the keys), before anything is calibrated or written."""
    cfg = tiny_cfg(synthetic_data, str(tmp_path / "w"), num_images=2, steps=1, **PAPER)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    rtdetr = os.path.join(ROOT, "checkpoints", "rtdetr_r18_synthetic.pth")
    with pytest.raises(SystemExit, match=r"rtdetr_r18_synthetic.pth does not fit this model: \d+ model key\(s\) missing"):
        _calibrate_tool().main([str(cfg_path), "--checkpoint", rtdetr, "--work-dir", str(tmp_path / "w")])
    assert not os.path.exists(tmp_path / "w" / "latte_calibrated.pth")
    # the explicit option accepts the partial load
    report = _calibrate_tool().main([str(cfg_path), "--checkpoint", rtdetr, "--work-dir", str(tmp_path / "w"),
                                     "--allow-partial-load"])
    assert os.path.exists(report["paths"]["checkpoint"])


@pytest.mark.parametrize("kind", ["truncated", "text", "missing"])
def test_an_unreadable_checkpoint_is_one_line_naming_the_file(synthetic_data, tmp_path, kind):
    cfg = tiny_cfg(synthetic_data, str(tmp_path / "w"))
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    bad = tmp_path / f"{kind}.pth"
    if kind == "truncated":
        bad.write_bytes(open(os.path.join(ROOT, "checkpoints", "cond_detr_r18_synthetic.pth"), "rb").read()[:100_000])
    elif kind == "text":
        bad.write_text("not a checkpoint\n")
    with pytest.raises(SystemExit) as exc:
        _calibrate_tool().main([str(cfg_path), "--checkpoint", str(bad), "--work-dir", str(tmp_path / "w")])
    msg = str(exc.value)
    assert str(bad) in msg and "\n" not in msg
    assert ("no such checkpoint file" if kind == "missing" else "is not a readable checkpoint") in msg


def test_the_hook_refuses_a_mismatched_checkpoint_in_mmdets_own_test_script(synthetic_data, tmp_path):
    """mmdet's Runner (as tools/test.py uses it) with load_from = another model's checkpoint."""
    from mmengine.runner import Runner

    from latte_plugin.storage import CheckpointError

    cfg = tiny_cfg(synthetic_data, str(tmp_path))
    cfg.load_from = os.path.join(ROOT, "checkpoints", "rtdetr_r18_synthetic.pth")
    runner = Runner.from_cfg(cfg)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        runner.test()


@pytest.mark.parametrize("name,count,linear", [("cond_detr_r18_synthetic_latte.py", 6, 4),
                                               ("rtdetr_r18_synthetic_latte.py", 7, 5)])
def test_embedded_latte_configs_swap_their_candidates(name, count, linear):
    """The embedded LATTE configs (the main job's) name candidates that exist: 6 and 7 layers."""
    from mmengine.config import Config

    from latte_plugin.calibration.config import LatteConfig
    from latte_plugin.calibration.config import num_linear_layers
    from latte_plugin.mmdet import install_latte_cores

    cfg = Config.fromfile(os.path.join(ROOT, "configs", "mmdet", "embedded", name))
    hook = {k: v for k, v in cfg.custom_hooks[0].items() if k != "type"}
    latte = LatteConfig.from_dict(hook)
    names = install_latte_cores(_build(cfg.model), latte)
    assert len(names) == count and num_linear_layers(count, latte.ratio, latte.num_linear) == linear


def test_target_budgets_detection_disagreement_on_the_embedded_detector(synthetic_data, tmp_path):
    """target= on a detector: the mmdet adapter's detect() runs mmdet's own post-processing, the
    flow budgets 1 - agreement of the hybrid's confident detections with the exact model's, and
    the report gives the count it allowed and the figure on the report images."""
    from latte_plugin.calibration.measures import DetectionDisagreement
    from latte_plugin.mmdet.workflow import run_calibration

    cfg = tiny_cfg(synthetic_data, str(tmp_path), path=os.path.join(ROOT, "configs", "mmdet", "embedded",
                                                                     "cond_detr_r18_synthetic_latte.py"),
                   num_images=4, steps=2)
    cfg_path = tmp_path / "embedded.py"
    cfg.dump(str(cfg_path))
    report = run_calibration(str(cfg_path), os.path.join(ROOT, "checkpoints", "cond_detr_r18_synthetic.pth"),
                             str(tmp_path / "cal"), overrides=dict(target=0.05, greedy_images=2))
    sel = report["selection"]
    assert sel["target"]["measure"] == DetectionDisagreement.name == sel["heldout"]["measure"]
    assert sel["k"] == sel["target"]["k"] == len(report["linearized"])
    losses = {int(k): v for k, v in sel["target"]["losses"].items()}
    assert all(min(v.values()) > 0.05 for k, v in losses.items() if k > sel["k"])
    assert sel["k"] == 0 or min(losses[sel["k"]].values()) <= 0.05
    assert losses[6]["score"] > 0  # all six linear changes the detections


def test_hook_applies_mode_and_threshold_to_a_loaded_calibration(synthetic_data, tmp_path):
    """mmdet's Runner with a calibrated checkpoint and calibrate='auto': the hook's mode='dynamic'
    and threshold take effect on the linear layers without recalibrating."""
    from mmengine.runner import Runner

    cfg = tiny_cfg(synthetic_data, str(tmp_path / "cal"), num_images=2, steps=1, **PAPER)
    cfg_path = tmp_path / "tiny.py"
    cfg.dump(str(cfg_path))
    report = _calibrate_tool().main([str(cfg_path), "--work-dir", str(tmp_path / "cal")])
    cfg = tiny_cfg(synthetic_data, str(tmp_path / "dyn"), mode="dynamic", threshold=9, calibrate="auto")
    cfg.load_from = report["paths"]["checkpoint"]
    runner = Runner.from_cfg(cfg)
    runner.test()
    layers = find_latte_layers(runner.model)
    assert {n for n, l in layers.items() if l.mode == "dynamic"} == set(report["linearized"])
    assert all(int(l.threshold) == 9 for l in layers.values())
    assert not os.path.exists(tmp_path / "dyn" / "latte_report.json")  # nothing recalibrated
