"""Every script a user or a developer runs answers ``--help`` with exit 0 and a usage line (the
first thing a user types), as it is run: the user's commands and the examples by path
(``python tools/calibrate.py``), the evidence jobs and benchmarks as modules
(``python -m experiments.main_job``). All of them in one fresh interpreter (one start-up,
not 35), each under ``runpy`` exactly as ``python`` would run it."""
import glob
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

BY_PATH = sorted(os.path.relpath(p, ROOT) for d in ("tools", "examples") for p in glob.glob(os.path.join(ROOT, d, "*.py"))
                 if not p.endswith("__init__.py"))
AS_MODULE = sorted(os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".") for d in ("experiments", "benchmarks")
                   for p in glob.glob(os.path.join(ROOT, d, "*.py")) if not p.endswith("__init__.py"))

_RUNNER = r"""
import contextlib, io, json, runpy, sys
out = {}
for kind, name in json.loads(sys.argv[1]):
    buf, code = io.StringIO(), None
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(name, run_name="__main__") if kind == "path" else runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # an import error or a crash: reported, not raised
        code = f"{type(e).__name__}: {e}"
    out[name] = [code, buf.getvalue()[:300]]
print("RESULTS" + json.dumps(out))
"""


def test_the_scripts_are_found():
    assert "tools/calibrate.py" in BY_PATH and "experiments.main_job" in AS_MODULE
    assert any(s.startswith("benchmarks.") for s in AS_MODULE) and "examples/linearize_hf_vit.py" in BY_PATH


def test_every_script_answers_help():
    todo = [["path", s] for s in BY_PATH] + [["module", m] for m in AS_MODULE]
    res = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(todo)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert "RESULTS" in res.stdout, res.stderr[-3000:]
    results = json.loads(res.stdout.split("RESULTS", 1)[1])
    bad = {n: r for n, r in results.items() if r[0] not in (0, None) or "usage:" not in r[1]}
    assert not bad, bad
    assert set(results) == set(BY_PATH) | set(AS_MODULE)


def test_the_demo_answers_help_without_setting_anything_up():
    out = subprocess.run(["bash", "tools/demo.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--full" in out.stdout, out.stderr
    bad = subprocess.run(["bash", "tools/demo.sh", "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown option --fast" in bad.stdout


def test_a_help_description_is_the_docstrings_whole_first_paragraph():
    """``--help`` shows the module docstring's first paragraph, not a first line cut mid-sentence."""
    from latte_plugin.console import first_paragraph

    doc = "Rewrites a checkpoint (a zoo file) as\n``{'meta', 'state_dict'}``.\n\n    python tools/slim.py a b\n"
    assert first_paragraph(doc) == "Rewrites a checkpoint (a zoo file) as ``{'meta', 'state_dict'}``."
