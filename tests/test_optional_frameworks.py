"""Optional frameworks: a missing one skips its tests with the reason; a broken import fails."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import OPTIONAL, ROOT, require


@pytest.mark.parametrize("how", ["absent", "broken"])
def test_missing_detectron2_skips_its_module_with_the_reason(tmp_path, how):
    """pytest in a subprocess where ``import detectron2`` fails, as on a machine without it
    (absent) or with an install that cannot be imported (a shim raising ImportError): exit 0,
    and the detectron2 tests reported as skipped with the reason."""
    env = dict(os.environ)
    if how == "absent":
        prelude = "sys.modules['detectron2'] = None; "
    else:
        (tmp_path / "detectron2").mkdir()
        (tmp_path / "detectron2" / "__init__.py").write_text('raise ImportError("detectron2 is unavailable (simulated)")\n')
        env["PYTHONPATH"] = str(tmp_path)  # a stand-in that hides the installed framework
        prelude = ""
    code = (f"import sys; {prelude}import pytest; "
            "sys.exit(pytest.main(['-rs', '-q', '-p', 'no:cacheprovider', 'tests/test_detectron2.py', "
            "'tests/test_optional_frameworks.py::test_absent_framework_skips']))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "1 passed, 1 skipped" in out, out
    assert ("detectron2 is not installed" if how == "absent" else "detectron2 is unavailable (simulated)") in out, out


def _fake_framework(tmp_path, monkeypatch, body: str) -> str:
    pkg = tmp_path / "fakefw_latte"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(OPTIONAL, "fakefw_latte", "fakefw_latte is not installed")
    return "fakefw_latte"


def test_a_framework_that_cannot_be_imported_skips_with_its_error(tmp_path, monkeypatch):
    """Installed but not importable (a missing dependency, a build without its C extension):
    unavailable, so its tests skip, and the reason carries the import error."""
    name = _fake_framework(tmp_path, monkeypatch, "import no_such_dependency_of_fakefw  # a broken install\n")
    with pytest.raises(pytest.skip.Exception, match="no_such_dependency_of_fakefw"):
        require(name)


def test_other_errors_inside_an_import_are_errors(tmp_path, monkeypatch):
    name = _fake_framework(tmp_path, monkeypatch, "raise RuntimeError('bug in the adapter')\n")
    with pytest.raises(RuntimeError, match="bug in the adapter"):
        require(name)


def test_our_own_modules_are_never_skipped():
    """require() is for optional frameworks only: our adapters are imported directly, so an
    import error in them fails the run."""
    with pytest.raises(ValueError, match="not an optional framework"):
        require("latte_plugin.detectron2")


def test_an_import_error_in_our_adapter_fails_collection(tmp_path):
    """A test module whose framework is present but whose adapter import breaks is an error."""
    (tmp_path / "test_broken_adapter.py").write_text(textwrap.dedent("""
        from tests.conftest import require
        require("transformers")  # present
        import latte_plugin.no_such_adapter  # noqa: F401  (our own module, broken)

        def test_never_runs():
            assert True
    """))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "error" in (res.stdout + res.stderr).lower(), res.stdout[-2000:]


def test_absent_framework_skips(monkeypatch):
    monkeypatch.setitem(OPTIONAL, "fakefw_absent_latte", "fakefw_absent_latte is not installed")
    monkeypatch.setitem(sys.modules, "fakefw_absent_latte", None)
    with pytest.raises(pytest.skip.Exception, match="fakefw_absent_latte is not installed"):
        require("fakefw_absent_latte")
