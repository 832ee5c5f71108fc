"""A deterministic generator of small COCO-format detection splits.

Images hold filled shapes (square, disc, triangle) on a textured background. The same
seed gives the same bytes (PNG via OpenCV, JSON with sorted keys). No download.

Usage: ``python -m latte_plugin.data.synthetic OUT_DIR [--train 64] [--val 32] [--size 256]``
writes ``OUT_DIR/{train,val}/*.png`` and ``OUT_DIR/annotations/instances_{train,val}.json``.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

import numpy as np

CLASSES = ("square", "disc", "triangle")


def _draw(img: np.ndarray, cls: int, x0: int, y0: int, s: int, color: Sequence[int]) -> None:
    import cv2

    color = tuple(int(c) for c in color)
    if cls == 0:
        cv2.rectangle(img, (x0, y0), (x0 + s - 1, y0 + s - 1), color, thickness=-1)
    elif cls == 1:
        cv2.circle(img, (x0 + s // 2, y0 + s // 2), s // 2, color, thickness=-1)
    else:
        pts = np.array([[x0 + s // 2, y0], [x0, y0 + s - 1], [x0 + s - 1, y0 + s - 1]], dtype=np.int32)
        cv2.fillPoly(img, [pts], color)


def _split(out_dir: str, split: str, num_images: int, size: int, rng: np.random.Generator) -> None:
    import cv2

    img_dir = os.path.join(out_dir, split)
    os.makedirs(img_dir, exist_ok=True)
    images, annotations = [], []
    ann_id = 1
    for i in range(num_images):
        noise = rng.integers(0, 40, size=(size // 8, size // 8, 3), dtype=np.uint8)
        img = cv2.resize(noise, (size, size), interpolation=cv2.INTER_LINEAR)
        boxes: list[tuple[int, int, int, int]] = []
        for _ in range(int(rng.integers(1, 4))):
            for _try in range(20):
                s = int(rng.integers(size // 6, size // 3))
                x0, y0 = (int(v) for v in rng.integers(0, size - s, size=2))
                if all(x0 + s <= bx or bx + bs <= x0 or y0 + s <= by or by + bs <= y0 for bx, by, bs, _ in boxes):
                    break
            else:
                continue
            cls = int(rng.integers(0, len(CLASSES)))
            color = rng.integers(90, 256, size=3)
            _draw(img, cls, x0, y0, s, color)
            boxes.append((x0, y0, s, cls))
        name = f"{split}_{i:05d}.png"
        cv2.imwrite(os.path.join(img_dir, name), img)
        images.append({"id": i + 1, "file_name": name, "width": size, "height": size})
        for x0, y0, s, cls in boxes:
            annotations.append({"id": ann_id, "image_id": i + 1, "category_id": cls + 1,
                                "bbox": [x0, y0, s, s], "area": s * s, "iscrowd": 0})
            ann_id += 1
    coco = {"images": images, "annotations": annotations,
            "categories": [{"id": i + 1, "name": n} for i, n in enumerate(CLASSES)]}
    os.makedirs(os.path.join(out_dir, "annotations"), exist_ok=True)
    with open(os.path.join(out_dir, "annotations", f"instances_{split}.json"), "w") as f:
        json.dump(coco, f, sort_keys=True)


def make_synthetic_coco(out_dir: str, num_train: int = 64, num_val: int = 32, size: int = 256, seed: int = 0) -> str:
    """Writes the train and val splits under ``out_dir`` (skipped if already complete); returns ``out_dir``."""
    marker = os.path.join(out_dir, f".done-{num_train}-{num_val}-{size}-{seed}")
    if os.path.exists(marker):
        return out_dir
    rng = np.random.default_rng(seed)
    _split(out_dir, "train", num_train, size, rng)
    _split(out_dir, "val", num_val, size, rng)
    open(marker, "w").close()
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=64)
    p.add_argument("--val", type=int, default=32)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_synthetic_coco(a.out_dir, a.train, a.val, a.size, a.seed))


if __name__ == "__main__":
    main()
