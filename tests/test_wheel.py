"""The package as a user installs it: a wheel built from the repository, installed into a
temporary target, used from outside the clone. It finds its own data files (every family's
default architecture, through ``importlib.resources``), runs ``latte_plugin.linearize`` on an
HF ViT, and its commands answer ``--help``."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, require

_USE = r"""
import json, sys, torch
import latte_plugin
from latte_plugin.hf.detectors import FAMILIES, build_detector
from latte_plugin.resources import architecture_names
from transformers import ViTConfig, ViTModel

assert latte_plugin.__file__.startswith(sys.argv[1]), latte_plugin.__file__  # the installed copy, not the clone
built = {}
for name, fam in FAMILIES.items():
    with torch.device("meta"):  # the real architecture, no memory: what matters is that its JSON is found
        model = build_detector(name, fam.architecture)
    built[name] = [type(model).__name__, sum(p.numel() for p in model.parameters())]
model = ViTModel(ViTConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8)).eval()
batches = [{"pixel_values": torch.randn(2, 3, 32, 32)} for _ in range(4)]
model, report = latte_plugin.linearize(model, batches, candidates=["layers.*.attention"], ratio=0.67, steps=2,
                                       signal=False, log=lambda s: None, progress=False)
print("RESULT" + json.dumps({"built": built, "names": architecture_names(), "linear": report["linearized"]}))
"""


def _source_copy(dest) -> str:
    """What the wheel is built from, copied: pip builds in the source tree (build/, *.egg-info),
    so two test workers building from the clone at once would race, and a build there leaves files."""
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), dest / name)
    shutil.copytree(os.path.join(ROOT, "latte_plugin"), dest / "latte_plugin",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return str(dest)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp_path_factory.mktemp("source"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp / "dist")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    wheel = glob.glob(str(tmp / "dist" / "latte_plugin-*.whl"))
    assert len(wheel) == 1, wheel
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp / "site"), wheel[0]],
                   check=True, capture_output=True, text=True, timeout=300)
    return tmp


def _outside(installed, *args):
    env = dict(os.environ, PYTHONPATH=str(installed / "site"))  # the wheel's copy first, as an install puts it
    return subprocess.run([sys.executable, *args], cwd=str(installed), env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_wheel_ships_its_data_files(installed):
    shipped = sorted(os.listdir(installed / "site" / "latte_plugin" / "resources" / "architectures"))
    ours = sorted(os.listdir(os.path.join(ROOT, "latte_plugin", "resources", "architectures")))
    assert shipped == ours and len(ours) >= 9


def test_installed_outside_the_clone_it_builds_every_family_and_linearizes(installed):
    require("transformers")
    res = _outside(installed, "-c", _USE, str(installed / "site"))
    assert "RESULT" in res.stdout, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    from latte_plugin.hf.detectors import FAMILIES

    assert set(out["built"]) == set(FAMILIES) and all(n > 1_000_000 for _, n in out["built"].values()), out["built"]
    assert sorted(f.architecture for f in FAMILIES.values()) == sorted(out["names"])
    assert len(out["linear"]) == 2


def test_installed_commands_answer_help(installed):
    for cmd in ("calibrate", "export_onnx", "slim_checkpoint", "convert_rtdetr_original"):
        res = _outside(installed, "-m", f"latte_plugin.cli.{cmd}", "--help")
        assert res.returncode == 0 and "usage:" in res.stdout, (cmd, res.stderr[-2000:])
