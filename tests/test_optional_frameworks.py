"""Optional frameworks: a missing one skips its tests with the reason; a broken import fails."""
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import OPTIONAL, ROOT, require


def test_missing_detectron2_skips_its_module_with_the_reason():
    """pytest in a subprocess where ``import detectron2`` fails as on a machine without it:
    exit 0, and the detectron2 tests reported as skipped with the reason."""
    code = ("import sys; sys.modules['detectron2'] = None; import pytest; "
            "sys.exit(pytest.main(['-rs', '-q', '-p', 'no:cacheprovider', 'tests/test_detectron2.py', "
            "'tests/test_optional_frameworks.py::test_absent_framework_skips']))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "1 passed, 1 skipped" in out and "detectron2 is not installed" in out, out
    assert "error" not in out.lower().split("short test summary")[-1], out


def _fake_framework(tmp_path, monkeypatch, body: str) -> str:
    pkg = tmp_path / "fakefw_latte"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(OPTIONAL, "fakefw_latte", "fakefw_latte is not installed")
    return "fakefw_latte"


def test_broken_import_inside_an_installed_framework_is_an_error(tmp_path, monkeypatch):
    name = _fake_framework(tmp_path, monkeypatch, "import no_such_dependency_of_fakefw  # a broken install\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_fakefw"):
        require(name)


def test_other_errors_inside_an_import_are_errors(tmp_path, monkeypatch):
    name = _fake_framework(tmp_path, monkeypatch, "raise RuntimeError('bug in the adapter')\n")
    with pytest.raises(RuntimeError, match="bug in the adapter"):
        require(name)


def test_absent_framework_skips(monkeypatch):
    monkeypatch.setitem(OPTIONAL, "fakefw_absent_latte", "fakefw_absent_latte is not installed")
    monkeypatch.setitem(sys.modules, "fakefw_absent_latte", None)
    with pytest.raises(pytest.skip.Exception, match="fakefw_absent_latte is not installed"):
        require("fakefw_absent_latte")
