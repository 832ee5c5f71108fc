"""Atomic writes: an interrupted write leaves the previous file intact; round trips are exact."""
import json
import os
import signal
import subprocess
import sys

import torch

from latte_plugin.storage import atomic_torch_save, atomic_write_json

SLOW_WRITER = r"""
import sys, time, torch
from latte_plugin.storage import atomic_torch_save

class Slow:
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(60)  # killed here, mid-write
        return (int, (0,))

atomic_torch_save({{"state_dict": {{"w": torch.ones(1000)}}, "slow": Slow()}}, {path!r})
"""


def test_killed_write_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "latte_calibrated.pth")
    good = {"meta": {"v": 1}, "state_dict": {"w": torch.arange(10.0)}}
    atomic_torch_save(good, path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER.format(path=path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    back = torch.load(path, weights_only=True)
    assert back["meta"] == good["meta"] and torch.equal(back["state_dict"]["w"], good["state_dict"]["w"])


def test_json_and_checkpoint_round_trip_exactly(tmp_path):
    rep = {"variant": "latte", "sensitivity": {"a": 0.1234567890123, "b": 1e-300}, "linearized": ["a"]}
    atomic_write_json(rep, str(tmp_path / "r.json"))
    assert json.load(open(tmp_path / "r.json")) == rep
    state = {"x": torch.randn(3, 4, dtype=torch.float64), "m": torch.tensor(0.5)}
    atomic_torch_save({"state_dict": state}, str(tmp_path / "c.pth"))
    back = torch.load(tmp_path / "c.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # no temporary left behind
