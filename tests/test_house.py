"""The house rules a newcomer relies on, checked: short functions in the package, tools and
benchmarks; the flow's module stays a readable size; core imports only torch."""
import ast
import os
import subprocess

from tests.conftest import ROOT

MAX_FUNCTION_LINES = 60


def _python_files(*dirs):
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [f for f in files if f.startswith(dirs)]


def test_no_function_over_60_lines():
    long = []
    for f in _python_files("latte_plugin/", "tools/", "benchmarks/", "examples/"):
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{f}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into steps: " + "; ".join(long)


def test_the_flow_stays_readable_and_core_imports_only_torch():
    with open(os.path.join(ROOT, "latte_plugin", "core", "flow.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 400
    allowed = {"torch", "triton", "numpy", "__future__"}
    stdlib_ok = {"dataclasses", "typing", "math", "itertools", "fnmatch", "os", "json", "tempfile", "functools"}
    for f in _python_files("latte_plugin/core/"):
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for n in names:
                top = n.split(".")[0]
                assert top in allowed | stdlib_ok, f"{f} imports {n}: core imports only torch"


def test_every_docs_anchor_the_code_cites_exists():
    """The code cites ``docs/method.md#anchor`` instead of section numbers: each anchor must exist,
    and the method and architecture pages must be there (inside the repository)."""
    import re

    with open(os.path.join(ROOT, "docs", "method.md"), encoding="utf-8") as f:
        anchors = set(re.findall(r'<a id="([\w-]+)"></a>', f.read()))
    assert os.path.isfile(os.path.join(ROOT, "docs", "architecture.md"))
    cited = {}
    for f in _python_files("latte_plugin/", "tools/", "benchmarks/"):
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            for anchor in re.findall(r"docs/method\.md#([\w-]+)", fh.read()):
                cited.setdefault(anchor, f)
    assert cited, "the code cites no docs/method.md section"
    missing = {a: f for a, f in cited.items() if a not in anchors}
    assert not missing, f"cited anchors missing from docs/method.md: {missing}"
