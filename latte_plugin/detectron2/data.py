"""The embedded generated dataset in detectron2's ``DatasetCatalog`` (COCO json, so
detectron2's own loader and ``COCOEvaluator`` read it)."""
from __future__ import annotations

import os

__all__ = ["register_synthetic", "resize_augmentations"]


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


def resize_augmentations(augmentations, size: tuple[int, int], where: str) -> None:
    """Every resize of a LazyCall'd augmentation list to ``size`` = ``(height, width)``, in place:
    ``Resize`` to that shape; ``ResizeShortestEdge`` (aspect kept) to a short side of the smaller
    and at most the larger of the two, as mmdet's ``keep_ratio`` fits the image inside ``size``.

    Raises:
        ValueError: the list has no resize to set (one line naming ``where``).
    """
    found = 0
    for aug in augmentations or []:
        target = aug.get("_target_") if hasattr(aug, "get") else None
        name = getattr(target, "__name__", str(target).rsplit(".", 1)[-1])
        if name == "Resize":
            aug.shape = (size[0], size[1])
        elif name == "ResizeShortestEdge":
            aug.short_edge_length, aug.max_size = min(size), max(size)
        else:
            continue
        found += 1
    if not found:
        raise ValueError(f"input_size: {where} has no Resize or ResizeShortestEdge to set (LazyCall'd); add one, "
                         "or leave input_size unset")
