"""Data files the package reads at run time, shipped inside it (package data) and found through
:mod:`importlib.resources`, so an installed wheel finds them as a checkout does.

* ``architectures/<name>.json``: each transformers detector family's smallest public COCO
  architecture, as config keywords (``_source`` names where it comes from).
"""
from __future__ import annotations

import json
from importlib import resources

__all__ = ["architecture_names", "read_architecture"]


def _folder():
    return resources.files(__name__).joinpath("architectures")


def architecture_names() -> list[str]:
    """The names of the shipped architectures (``"deimv2_dinov3_s"``, ...), sorted."""
    return sorted(p.name[: -len(".json")] for p in _folder().iterdir() if p.name.endswith(".json"))


def read_architecture(name: str) -> dict:
    """The config keywords of the shipped architecture ``name``.

    Raises:
        KeyError: no architecture of that name (names the ones there are).
    """
    path = _folder().joinpath(f"{name}.json")
    if not path.is_file():
        raise KeyError(f"{name!r} is not a shipped architecture; shipped: {', '.join(architecture_names())}")
    return json.loads(path.read_text(encoding="utf-8"))
