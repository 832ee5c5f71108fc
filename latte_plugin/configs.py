"""Which framework a config file belongs to (no framework imported)."""
from __future__ import annotations

import os
import re

__all__ = ["config_framework"]

_RELATIVE_IMPORT = re.compile(r"^from\s+\.([\w.]*)\s+import", re.MULTILINE)


def config_framework(path: str, _depth: int = 0) -> str:
    """``'detectron2'`` for a detectron2 LazyConfig: a Python file that imports detectron2 or
    ``latte_plugin.detectron2``, or imports (``from .base import ...``) a file that does.
    Anything else is taken as an mmdet config (``'mmdet'``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if re.search(r"^\s*(from|import)\s+(detectron2|latte_plugin\.detectron2)\b", text, re.MULTILINE):
        return "detectron2"
    if _depth < 8:
        for mod in _RELATIVE_IMPORT.findall(text):
            base = os.path.join(os.path.dirname(path), *mod.split(".")) + ".py"
            if mod and os.path.exists(base) and config_framework(base, _depth + 1) == "detectron2":
                return "detectron2"
    return "mmdet"
