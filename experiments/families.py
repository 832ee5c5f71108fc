#!/usr/bin/env python
"""Which attention layers each transformers detector family has, at its smallest public COCO
architecture and its default input size, as :mod:`latte_plugin.hf.discovery` classifies them
(one probe forward, random weights: the structure does not depend on them).

    python -m experiments.families --results results/families.json

The README's family table is generated from the JSON (experiments/readme_tables.py).
"""
from __future__ import annotations

import argparse
import json
import os
from latte_plugin.console import first_paragraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def family_row(name: str) -> dict:
    """One family's sites at its default size: kinds, tokens, and the configs that serve it."""
    import torch

    from latte_plugin.hf.detectors import FAMILIES, build_detector
    from latte_plugin.hf.discovery import detector_sites

    fam = FAMILIES[name]
    torch.manual_seed(0)
    model = build_detector(name, fam.architecture).eval()
    sites = detector_sites(model, tuple(fam.size))
    return {"family": name, "architecture": fam.architecture, "size": list(fam.size),
            "mmdet_config": f"configs/mmdet/hf_{fam.architecture}_latte_coco.py",
            "detectron2_config": f"configs/detectron2/hf_{fam.architecture}_latte_coco.py",
            "deformable": sum(type(m).__name__.endswith("MultiscaleDeformableAttention") for m in model.modules()),
            "sites": [{"name": s.name, "kind": s.kind, "tokens": s.tokens, "sequences": s.sequences}
                      for s in sites]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--results", default=os.path.join(ROOT, "results", "families.json"), help="JSON to write")
    p.add_argument("--families", nargs="*", help="only these (default: every family)")
    a = p.parse_args(argv)
    from latte_plugin.console import progress
    from latte_plugin.storage import atomic_write
    from latte_plugin.hf.detectors import FAMILIES

    names = a.families or list(FAMILIES)
    out = {"command": "python -m experiments.families --results results/families.json",
           "rows": [family_row(n) for n in progress(names, len(names), "families")]}
    atomic_write(a.results, lambda f: f.write(json.dumps(out, indent=1).encode("utf-8")))
    return out


if __name__ == "__main__":
    main()
