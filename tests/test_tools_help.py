"""Every script a user or a developer runs answers ``--help`` with exit 0 (the first thing a
user types), in a fresh interpreter, and prints a usage line."""
import glob
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPTS = sorted(os.path.relpath(p, ROOT) for d in ("tools", "tools/evidence", "benchmarks", "examples")
                 for p in glob.glob(os.path.join(ROOT, d, "*.py")))


def test_the_scripts_are_found():
    assert "tools/calibrate.py" in SCRIPTS and "tools/evidence/main_job.py" in SCRIPTS
    assert any(s.startswith("benchmarks/") for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout, out.stdout[-500:]


def test_the_demo_answers_help_without_setting_anything_up():
    out = subprocess.run(["bash", "tools/demo.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--full" in out.stdout, out.stderr
    bad = subprocess.run(["bash", "tools/demo.sh", "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown option --fast" in bad.stdout
