"""The generated detection data: the original key-colour splits stay as they were, and the
two-key option labels every object with the colour of its nearer key, read back from the pixels."""
import json
import os

import numpy as np
import pytest

from latte_plugin.data.synthetic import CLASSES, CONTEXTS, _KEY_BGR, _NEARER, make_synthetic_coco

cv2 = pytest.importorskip("cv2")


def _load(root: str, split: str = "train"):
    with open(os.path.join(root, "annotations", f"instances_{split}.json")) as f:
        coco = json.load(f)
    for im in coco["images"]:
        img = cv2.imread(os.path.join(root, split, im["file_name"]))
        anns = [a for a in coco["annotations"] if a["image_id"] == im["id"]]
        yield img, anns


def _key_centres(img: np.ndarray) -> dict:
    """``{colour: (x, y)}``: the centre of the pixels in exactly that key colour."""
    out = {}
    for colour, bgr in _KEY_BGR.items():
        ys, xs = np.nonzero(np.all(img == np.array(bgr, dtype=np.uint8), axis=-1))
        if len(xs):
            out[colour] = (xs.mean(), ys.mean())
    return out


def test_two_key_images_name_the_nearer_key(tmp_path):
    root = make_synthetic_coco(str(tmp_path), num_train=24, num_val=2, size=256, seed=1, two_keys=1.0)
    checked = 0
    for img, anns in _load(root):
        keys = _key_centres(img)
        assert set(keys) == set(CONTEXTS), "a two-key image holds one red and one blue key"
        (rx, ry), (bx, by) = keys["red"], keys["blue"]
        assert np.hypot(rx - bx, ry - by) >= 256 / 2 - 1
        for a in anns:
            x, y, w, h = a["bbox"]
            cx, cy = x + w / 2, y + h / 2
            d = {c: np.hypot(cx - kx, cy - ky) for c, (kx, ky) in keys.items()}
            near = min(d, key=d.get)
            assert CLASSES[a["category_id"] - 1].endswith("-" + near)
            assert max(d.values()) >= _NEARER * min(d.values()) - 1.0  # pixel centres: about a pixel of slack
            checked += 1
    assert checked >= 24


def test_two_key_share_and_original_data(tmp_path):
    """``two_keys=0`` keeps one key per image (the original data); a share of 0.5 mixes both kinds;
    the same seed and option give the same bytes."""
    one = make_synthetic_coco(str(tmp_path / "one"), num_train=16, num_val=2, size=128, seed=4)
    assert all(len(_key_centres(img)) == 1 for img, _ in _load(one))
    mixed = make_synthetic_coco(str(tmp_path / "mixed"), num_train=40, num_val=2, size=128, seed=4, two_keys=0.5)
    counts = [len(_key_centres(img)) for img, _ in _load(mixed)]
    assert 5 <= counts.count(2) <= 35 and counts.count(1) + counts.count(2) == 40
    again = make_synthetic_coco(str(tmp_path / "again"), num_train=40, num_val=2, size=128, seed=4, two_keys=0.5)
    for name in sorted(os.listdir(os.path.join(mixed, "train")))[:5]:
        with open(os.path.join(mixed, "train", name), "rb") as a, open(os.path.join(again, "train", name), "rb") as b:
            assert a.read() == b.read()


def test_two_keys_share_out_of_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match="two_keys=1.5"):
        make_synthetic_coco(str(tmp_path), two_keys=1.5)
