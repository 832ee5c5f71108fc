"""A deterministic generator of small COCO-format detection splits.

Images hold light-grey squares and discs on a dark textured background, plus one small
red or blue *key* marker away from them. An object's class is its shape *and* the key's
colour (4 classes), so labels depend on long-range context. The same seed gives the same
bytes (PNG via OpenCV, JSON with sorted keys). No download.

With ``two_keys=p`` (``--two-keys P``), a share ``p`` of the images holds *two* larger keys
instead, one red and one blue, and each object takes the colour of the key nearer to it (at least
1.5x nearer). Both colours are then always present, so no image-wide average tells the colour:
the detector has to look at the right key, which is what global attention does and the uniform
control (every attention replaced by the mean of its values) cannot.

Usage: ``python -m latte_plugin.data.synthetic OUT_DIR [--train 64] [--val 32] [--size 256]``
writes ``OUT_DIR/{train,val}/*.png`` and ``OUT_DIR/annotations/instances_{train,val}.json``;
with ``--coco-layout``, COCO 2017's layout and 80 categories instead (for the COCO configs).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
from latte_plugin.console import first_paragraph

#: Object class = shape x context. The context is the colour of one small key marker
#: placed elsewhere in the image, so naming an object needs information from far away:
#: the encoder's global attention is what carries it (docs/results.md, "The embedded default").
SHAPES = ("square", "disc")
CONTEXTS = ("red", "blue")
CLASSES = tuple(f"{s}-{c}" for s in SHAPES for c in CONTEXTS)
_KEY_BGR = {"red": (40, 40, 230), "blue": (230, 60, 40)}


def _overlaps(box, boxes, margin: int = 4) -> bool:
    x0, y0, s0 = box
    return any(not (x0 + s0 + margin <= x or x + s + margin <= x0 or y0 + s0 + margin <= y or y + s + margin <= y0)
               for x, y, s in boxes)


def _draw(img: np.ndarray, shape: str, x0: int, y0: int, s: int, color: Sequence[int]) -> None:
    import cv2

    color = tuple(int(c) for c in color)
    if shape == "square":
        cv2.rectangle(img, (x0, y0), (x0 + s - 1, y0 + s - 1), color, thickness=-1)
    else:
        cv2.circle(img, (x0 + s // 2, y0 + s // 2), s // 2, color, thickness=-1, lineType=cv2.LINE_AA)


#: COCO 2017's 80 detection categories: (id, name), ids 1..90 with COCO's gaps.
COCO_CATEGORIES = tuple(zip(
    [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)],
    ("person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
     "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
     "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
     "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
     "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
     "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
     "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
     "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
     "hair drier", "toothbrush")))
#: In the COCO layout, the 4 synthetic classes are written as these real COCO categories
#: (ids with gaps below them and the last id, so a label/id mix-up shows).
COCO_LAYOUT_IDS = (1, 18, 44, 90)  # person, dog, bottle, toothbrush


#: With ``two_keys``: every key is ``size // 8`` wide and at least ``size // 8`` from every object;
#: the two keys' centres are at least ``size / 2`` apart, and an object's nearer key is at least
#: ``_NEARER`` times nearer (centre to centre) than the other.
_NEARER = 1.5


def _centre_distance(a, b) -> float:
    return float(np.hypot(a[0] + a[2] / 2 - b[0] - b[2] / 2, a[1] + a[2] / 2 - b[1] - b[2] / 2))


def _two_key_image(img: np.ndarray, size: int, width: int, rng: np.random.Generator) -> list:
    """Draws two keys (red and blue, in random places) and 1-3 objects, each labelled with the colour
    of its nearer key; returns ``[(x0, y0, s, class_index)]``."""
    key_size = size // 8
    for _try in range(100):
        keys = [(int(rng.integers(0, width - key_size)), int(rng.integers(0, size - key_size)), key_size)
                for _ in range(2)]
        if _centre_distance(*keys) >= size / 2:
            break
    colours = list(CONTEXTS) if rng.random() < 0.5 else list(reversed(CONTEXTS))
    placed: list[tuple[int, int, int]] = []
    objects = []
    for _ in range(int(rng.integers(1, 4))):
        for _try in range(60):
            s = int(rng.integers(size // 6, size // 3))
            box = (int(rng.integers(0, width - s)), int(rng.integers(0, size - s)), s)
            near, far = sorted(_centre_distance(box, k) for k in keys)
            if (not _overlaps(box, placed) and not _overlaps(box, keys, margin=size // 8)
                    and near * _NEARER <= far):
                break
        else:
            continue
        colour = colours[int(np.argmin([_centre_distance(box, k) for k in keys]))]
        shape = SHAPES[int(rng.integers(0, len(SHAPES)))]
        grey = int(rng.integers(150, 240))
        _draw(img, shape, *box, (grey + int(rng.integers(-10, 10)), grey, grey + int(rng.integers(-10, 10))))
        placed.append(box)
        objects.append((*box, CLASSES.index(f"{shape}-{colour}")))
    for (kx, ky, ks), colour in zip(keys, colours):
        _draw(img, "square", kx, ky, ks, _KEY_BGR[colour])
    return objects


@dataclass
class _Records:
    """One split's image folder and the COCO records written so far."""

    img_dir: str
    coco_layout: bool
    images: list = field(default_factory=list)
    annotations: list = field(default_factory=list)


def _write_image(records: _Records, img: np.ndarray, split: str, i: int, objects: list) -> None:
    """Writes image ``i`` ``(H, W, 3)`` and appends its COCO records (annotation ids continue from the last)."""
    import cv2

    name = f"{split}_{i:05d}.png"
    cv2.imwrite(os.path.join(records.img_dir, name), img)
    records.images.append({"id": i + 1, "file_name": name, "width": img.shape[1], "height": img.shape[0]})
    for x0, y0, s, cls in objects:
        records.annotations.append({"id": len(records.annotations) + 1, "image_id": i + 1,
                                    "category_id": COCO_LAYOUT_IDS[cls] if records.coco_layout else cls + 1,
                                    "bbox": [x0, y0, s, s], "area": s * s, "iscrowd": 0})


def _split(out_dir: str, split: str, num_images: int, size: int, rng: np.random.Generator,
           coco_layout: bool = False, width: Optional[int] = None, two_keys: float = 0.0) -> None:
    """One split; images are ``size`` high and ``width`` (default ``size``) wide; a share
    ``two_keys`` of them are two-key images (see the module's docstring)."""
    import cv2

    width = width or size

    img_dir = os.path.join(out_dir, split + ("2017" if coco_layout else ""))
    os.makedirs(img_dir, exist_ok=True)
    records = _Records(img_dir, coco_layout)
    # the option's single-key images use its larger key and margin too (the same look as its pairs)
    key_size, key_margin = (size // 8, size // 8) if two_keys else (max(8, size // 14), size // 16)
    for i in range(num_images):
        noise = rng.integers(0, 50, size=(size // 16, width // 16, 3), dtype=np.uint8)
        img = cv2.resize(noise, (width, size), interpolation=cv2.INTER_CUBIC)
        if two_keys and rng.random() < two_keys:
            objects = _two_key_image(img, size, width, rng)
            _write_image(records, img, split, i, objects)
            continue
        context = CONTEXTS[int(rng.integers(0, len(CONTEXTS)))]
        placed: list[tuple[int, int, int]] = []
        objects = []
        for _ in range(int(rng.integers(1, 4))):
            for _try in range(30):
                s = int(rng.integers(size // 6, size // 3))
                x0, y0 = int(rng.integers(0, width - s)), int(rng.integers(0, size - s))
                if not _overlaps((x0, y0, s), placed):
                    break
            else:
                continue
            shape = SHAPES[int(rng.integers(0, len(SHAPES)))]
            grey = int(rng.integers(150, 240))
            _draw(img, shape, x0, y0, s, (grey + int(rng.integers(-10, 10)), grey, grey + int(rng.integers(-10, 10))))
            placed.append((x0, y0, s))
            objects.append((x0, y0, s, CLASSES.index(f"{shape}-{context}")))
        for _try in range(50):  # the key marker, away from every object
            kx, ky = int(rng.integers(0, width - key_size)), int(rng.integers(0, size - key_size))
            if not _overlaps((kx, ky, key_size), placed, margin=key_margin):
                break
        cv2.rectangle(img, (kx, ky), (kx + key_size - 1, ky + key_size - 1), _KEY_BGR[context], thickness=-1)
        _write_image(records, img, split, i, objects)
    categories = ([{"id": i, "name": n, "supercategory": "none"} for i, n in COCO_CATEGORIES] if coco_layout
                  else [{"id": i + 1, "name": n} for i, n in enumerate(CLASSES)])
    coco = {"images": records.images, "annotations": records.annotations, "categories": categories}
    os.makedirs(os.path.join(out_dir, "annotations"), exist_ok=True)
    name = f"instances_{split}2017.json" if coco_layout else f"instances_{split}.json"
    with open(os.path.join(out_dir, "annotations", name), "w") as f:
        json.dump(coco, f, sort_keys=True)


def make_synthetic_coco(out_dir: str, num_train: int = 64, num_val: int = 32, size: int = 256, seed: int = 0,
                        two_keys: float = 0.0) -> str:
    """Writes the train and val splits under ``out_dir`` (skipped if already complete); returns
    ``out_dir``. ``two_keys``: the share of two-key images (module docstring); 0 = the original data."""
    if not 0.0 <= two_keys <= 1.0:
        raise ValueError(f"two_keys={two_keys}: a share of the images, between 0 and 1")
    option = f"-2k{two_keys:g}" if two_keys else ""
    marker = os.path.join(out_dir, f".done-v2-{num_train}-{num_val}-{size}-{seed}{option}")
    if os.path.exists(marker):
        return out_dir
    rng = np.random.default_rng(seed)
    _split(out_dir, "train", num_train, size, rng, two_keys=two_keys)
    _split(out_dir, "val", num_val, size, rng, two_keys=two_keys)
    open(marker, "w").close()
    return out_dir


def make_coco_layout(out_dir: str, num_train: int = 8, num_val: int = 4, size: int = 256, seed: int = 0,
                     width: Optional[int] = None) -> str:
    """The same images in COCO 2017's folder layout with its 80 real categories (ids 1..90 with
    gaps): ``annotations/instances_{train,val}2017.json``, ``train2017/``, ``val2017/``, so the
    COCO configs run on it unchanged apart from ``data_root``. Returns ``out_dir``."""
    marker = os.path.join(out_dir, f".done-coco-{num_train}-{num_val}-{size}x{width or size}-{seed}")
    if os.path.exists(marker):
        return out_dir
    rng = np.random.default_rng(seed)
    _split(out_dir, "train", num_train, size, rng, coco_layout=True, width=width)
    _split(out_dir, "val", num_val, size, rng, coco_layout=True, width=width)
    open(marker, "w").close()
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=64)
    p.add_argument("--val", type=int, default=32)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--two-keys", type=float, default=0.0, metavar="P",
                   help="share of images with two keys (red and blue); objects take the nearer key's colour")
    p.add_argument("--coco-layout", action="store_true",
                   help="COCO 2017's layout and 80 categories (train2017/, val2017/, instances_*2017.json)")
    a = p.parse_args()
    if a.coco_layout:
        print(make_coco_layout(a.out_dir, a.train, a.val, a.size, a.seed))
    else:
        print(make_synthetic_coco(a.out_dir, a.train, a.val, a.size, a.seed, two_keys=a.two_keys))


if __name__ == "__main__":
    main()
