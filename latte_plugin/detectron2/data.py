"""The embedded generated dataset in detectron2's ``DatasetCatalog`` (COCO json, so
detectron2's own loader and ``COCOEvaluator`` read it)."""
from __future__ import annotations

import os

__all__ = ["register_synthetic"]


def register_synthetic(root: str = "data/synthetic", prefix: str = "latte_synthetic") -> tuple[str, str]:
    """Registers ``{prefix}_train`` / ``{prefix}_val`` for the split under ``root``; returns their names.

    Idempotent for the same ``root``; a name registered for another root is re-registered (a
    silently kept old registration would calibrate and evaluate on the wrong images).
    """
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from detectron2.data.datasets import register_coco_instances

    names = []
    for split in ("train", "val"):
        name = f"{prefix}_{split}"
        json_file = os.path.join(root, "annotations", f"instances_{split}.json")
        if name in DatasetCatalog.list() and MetadataCatalog.get(name).get("json_file") != json_file:
            DatasetCatalog.remove(name)
            MetadataCatalog.remove(name)
        if name not in DatasetCatalog.list():
            register_coco_instances(name, {}, json_file, os.path.join(root, split))
        names.append(name)
    return names[0], names[1]
