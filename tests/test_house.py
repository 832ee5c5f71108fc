"""The house rules a newcomer relies on, checked (``docs/architecture.md``):

* no import circle inside ``latte_plugin``, type-only and function-level imports included;
* each layer imports only the layers below it (``ops`` torch only; ``nn`` ``ops``; ``calibration``
  ``nn`` and ``ops``; an adapter never the other framework, detectron2's one bridge module aside);
* no module over 450 lines; no function over 60 lines or over 8 parameters (constructors and
  Triton kernels aside);
* no ``sys.path`` edit in any tracked file, and no file named like a package it would shadow;
* every ``docs/method.md#anchor`` the code cites exists.
"""
import ast
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 450, 60, 8


def _tracked(*suffixes: str) -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [f for f in files if f.endswith(suffixes) and os.path.exists(os.path.join(ROOT, f))]


def _package_files() -> list[str]:
    return [f for f in _tracked(".py") if f.startswith("latte_plugin/")]


def _module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _tree(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read())


def _imports(path: str) -> set[str]:
    """Every ``latte_plugin`` module ``path`` imports, anywhere in the file (``from . import x``
    counts as module ``x`` when it is one)."""
    modules = {_module_name(f) for f in _package_files()}
    me = _module_name(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
            out |= subs if len(subs) == len(node.names) else subs | {base}  # a package's own names: its __init__
    return {m for m in out if m in modules and m != me}


def _graph() -> dict[str, set[str]]:
    return {_module_name(f): _imports(f) for f in _package_files()}


def naive_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself, with one path back (depth-first, the plain way)."""
    found = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_the_cycle_check_finds_a_circle():
    assert naive_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert not naive_cycles({"a": {"b"}, "b": {"c"}, "c": set()})


def test_no_import_circle_in_the_package():
    graph = _graph()
    assert len(graph) > 40 and "latte_plugin.calibration.flow" in graph
    assert not naive_cycles(graph), naive_cycles(graph)[:3]


#: What each part of the package may import (``latte_plugin.<part>``), beside torch and the stdlib.
ALLOWED = {"ops": set(), "nn": {"ops"}, "calibration": {"nn", "ops"}, "storage": set(), "resources": set(),
           "console": set()}


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for module, targets in _graph().items():
        part = module.split(".")[1] if "." in module else ""
        for t in targets:
            other = t.split(".")[1] if "." in t else ""
            if part in ALLOWED and other != part and other not in ALLOWED[part]:
                bad.append(f"{module} imports {t}")
            if part == "mmdet" and other == "detectron2":
                bad.append(f"{module} imports {t}")
            if part == "detectron2" and other == "mmdet" and module != "latte_plugin.detectron2.mmdet_bridge":
                bad.append(f"{module} imports {t}: only detectron2/mmdet_bridge.py reaches mmdet")
    assert not bad, bad
    # and the frameworks themselves: ops, nn and calibration import torch, never mmdet or detectron2
    for f in _package_files():
        if f.split("/")[1] in ("ops", "nn", "calibration"):
            for node in ast.walk(_tree(f)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
                for n in names:
                    assert n.split(".")[0] not in ("mmdet", "mmengine", "mmcv", "detectron2", "transformers"), (f, n)
    for f in _package_files():
        if f.startswith("latte_plugin/detectron2/") and not f.endswith("mmdet_bridge.py"):
            for node in ast.walk(_tree(f)):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    assert not any(n.split(".")[0] in ("mmdet", "mmengine", "mmcv") for n in names), f


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_modules_and_functions_stay_small():
    big, long, many = [], [], []
    for f in _package_files():
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            text = fh.read()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{f} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_triton_kernel(node):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{f}:{node.lineno} {node.name} ({lines} lines)")
            a = node.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            params += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            if len(params) > MAX_PARAMETERS and node.name != "__init__":
                many.append(f"{f}:{node.lineno} {node.name} ({len(params)} parameters)")
    assert not big, f"split these modules by job: {big}"
    assert not long, f"split these into steps: {long}"
    assert not many, f"group these parameters into a typed object: {many}"


def test_no_sys_path_edits_and_no_file_shadows_a_package():
    edit = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*(\[[^]]*\])?\s*[+]?=")
    edits = []
    for f in _tracked(".py", ".sh"):
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if edit.search(line) and f != "tests/test_house.py":
                    edits.append(f"{f}:{i}")
    assert not edits, f"import through the installed package or `python -m`, not sys.path: {edits}"
    importable = {"onnx", "onnxruntime", "torch", "transformers", "mmdet", "mmengine", "mmcv", "detectron2", "numpy",
                  "triton", "safetensors", "rich", "matplotlib", "pytest", "scipy"} | set(sys.stdlib_module_names)
    top_dirs = ("tools/", "experiments/", "benchmarks/", "examples/", "tests/")
    shadows = [f for f in _tracked(".py") if f.startswith(top_dirs) and os.path.basename(f)[:-3] in importable]
    assert not shadows, f"these files shadow a package when their folder is on sys.path: {shadows}"


def test_every_docs_anchor_the_code_cites_exists():
    """The code cites ``docs/method.md#anchor`` instead of section numbers: each anchor must exist."""
    with open(os.path.join(ROOT, "docs", "method.md"), encoding="utf-8") as f:
        anchors = set(re.findall(r'<a id="([\w-]+)"></a>', f.read()))
    cited = {}
    for f in _tracked(".py"):
        if f == "tests/test_house.py":
            continue
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            for anchor in re.findall(r"docs/method\.md#([\w-]+)", fh.read()):
                cited.setdefault(anchor, f)
    assert cited, "the code cites no docs/method.md section"
    missing = {a: f for a, f in cited.items() if a not in anchors}
    assert not missing, f"cited anchors missing from docs/method.md: {missing}"
