"""Every Python block in README.md and docs/ is tested, one of three ways:

* a **config block** (its first line names the file, ``# configs/...py``) is loaded by its own
  framework's loader (mmengine's ``Config``, detectron2's ``LazyConfig``) beside the named file's
  siblings, and its LATTE settings and model keys equal the named file's;
* a **runnable block** (the line above it says ``<!-- runs in tests/test_docs.py -->``) runs here,
  with the sizes shrunk by the substitutions in :data:`TINY` (each must apply: a block cannot drift
  away from what is run);
* a **fragment** (the line above it is ``<!-- fragment: tests/<file>.py::<test> -->``) is covered by
  the named test, which must exist, and every call in it must appear in a runnable block or in
  that test's file.
"""
import os
import re

import pytest

from tests.conftest import ROOT, require

PAGES = ["README.md"] + sorted(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```python\n(.*?)^```$", re.S | re.M)
RUNS = "<!-- runs in tests/test_docs.py -->"
#: What the runnable blocks run with here: (text in the block, tiny replacement).
TINY = {"README.md": [("ViTConfig(num_hidden_layers=6)", "ViTConfig(num_hidden_layers=3, hidden_size=32, "
                       "num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)"),
                      ("torch.randn(2, 3, 224, 224)", "torch.randn(2, 3, 32, 32)")]}


def blocks() -> list[tuple[str, str, str]]:
    """``(page, marker line or '', code)`` of every Python block."""
    out = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            out += [(page, m.group(1) or "", m.group(2)) for m in BLOCK.finditer(f.read())]
    return out


def _kind(marker: str, code: str) -> str:
    if code.startswith("# configs/"):
        return "config"
    if marker == RUNS:
        return "runs"
    if marker.startswith("<!-- fragment: tests/"):
        return "fragment"
    return "untested"


def test_every_python_block_is_tested_one_way():
    found = blocks()
    assert len(found) >= 7, "the pages have lost their Python blocks"
    untested = [(page, code.splitlines()[0]) for page, marker, code in found if _kind(marker, code) == "untested"]
    assert not untested, f"Python blocks that no test covers (mark them, see this file's docstring): {untested}"


@pytest.mark.parametrize("page, marker, code", [b for b in blocks() if _kind(b[1], b[2]) == "runs"],
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else "")
def test_runnable_blocks_run(page, marker, code):
    require("transformers")
    for text, tiny in TINY.get(page, []):
        assert text in code, f"{page}: the block no longer holds {text!r}; update TINY"
        code = code.replace(text, tiny)
    scope: dict = {}
    exec(compile(code, page, "exec"), scope)  # noqa: S102  (the page's own code)
    report = scope["report"]
    assert report["linearized"] and set(report["linearized"]) <= set(report["candidates"])


@pytest.mark.parametrize("page, marker, code", [b for b in blocks() if _kind(b[1], b[2]) == "fragment"],
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else "")
def test_fragments_name_a_test_that_covers_them(page, marker, code):
    target = marker[len("<!-- fragment: "):-len(" -->")]
    path, _, name = target.partition("::")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        test_source = f.read()
    assert f"def {name}(" in test_source, f"{page}: {target} does not exist"
    runnable = "".join(c for _, m, c in blocks() if _kind(m, c) == "runs")
    for call in re.findall(r"(latte_plugin\.[a-z_]+)\(", code):
        short = call.split(".")[-1]
        assert call in runnable or f"{short}(" in test_source, f"{page}: {call} is run neither by {target} nor a block"


def _config_blocks(framework: str):
    return [b for b in blocks() if _kind(b[1], b[2]) == "config" and b[2].split()[1].startswith(f"configs/{framework}")]


@pytest.mark.parametrize("page, marker, code", _config_blocks("mmdet"), ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else "")
def test_mmdet_config_blocks_load_and_say_what_their_file_says(page, marker, code, tmp_path):
    require("mmdet")
    from mmengine.config import Config

    from latte_plugin.calibration import LatteConfig

    named = os.path.join(ROOT, code.split()[1])
    here = tmp_path / os.path.dirname(code.split()[1])
    here.mkdir(parents=True)
    os.symlink(os.path.join(os.path.dirname(named), "_base_"), here / "_base_")
    (here / "block.py").write_text(code)
    block, file = Config.fromfile(str(here / "block.py")), Config.fromfile(named)

    def latte(cfg):
        hooks = [dict(h) for h in cfg.get("custom_hooks", []) if h["type"] == "LinearizeHook"]
        return [LatteConfig.from_dict({k: v for k, v in h.items() if k in LatteConfig.__dataclass_fields__}) for h in hooks]

    assert latte(block) == latte(file)
    assert block.get("custom_imports") == file.get("custom_imports")
    for key in ("family", "pretrained", "type"):
        assert block.model.get(key) == file.model.get(key), key
    assert block.get("train_cfg", {}).get("max_epochs") == file.get("train_cfg", {}).get("max_epochs")


@pytest.mark.parametrize("page, marker, code", _config_blocks("detectron2"),
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else "")
def test_detectron2_config_blocks_load_and_say_what_their_file_says(page, marker, code, tmp_path):
    require("detectron2")
    require("mmdet")
    from detectron2.config import LazyConfig

    named = os.path.join(ROOT, code.split()[1])
    here = tmp_path / os.path.dirname(code.split()[1])
    here.mkdir(parents=True)
    for sibling in os.listdir(os.path.dirname(named)):
        if sibling != os.path.basename(named):
            os.symlink(os.path.join(os.path.dirname(named), sibling), here / sibling)
    (here / "block.py").write_text(code)
    block, file = LazyConfig.load(str(here / "block.py")), LazyConfig.load(named)
    assert dict(block.model.latte) == dict(file.model.latte)
    assert block.model._target_ == file.model._target_
