"""The embedded generated dataset in detectron2's ``DatasetCatalog`` (COCO json, so
detectron2's own loader and ``COCOEvaluator`` read it)."""
from __future__ import annotations

import os

__all__ = ["register_synthetic"]


def register_synthetic(root: str = "data/synthetic", prefix: str = "latte_synthetic") -> tuple[str, str]:
    """Registers ``{prefix}_train`` / ``{prefix}_val`` (idempotent); returns their names."""
    from detectron2.data import DatasetCatalog
    from detectron2.data.datasets import register_coco_instances

    names = []
    for split in ("train", "val"):
        name = f"{prefix}_{split}"
        if name not in DatasetCatalog.list():
            register_coco_instances(name, {}, os.path.join(root, "annotations", f"instances_{split}.json"),
                                    os.path.join(root, split))
        names.append(name)
    return names[0], names[1]
