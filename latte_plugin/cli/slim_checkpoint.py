#!/usr/bin/env python
"""Rewrites an mmdet checkpoint (a model-zoo file or a Runner's ``epoch_N.pth``) as
``{'meta', 'state_dict', 'model'}`` with tensors and plain types only, so that it loads in
mmdet (``state_dict``), in detectron2 (``model``: detectron2's ``DetectionCheckpointer``
cannot read mmdet's layout) and with ``torch.load(weights_only=True)``.

    python tools/slim_checkpoint.py detr_r50_8xb2-150e_coco_20221023_153551-436d03e8.pth detr_r50_d2.pth [--fp16]
"""
from __future__ import annotations

import argparse
from latte_plugin.console import first_paragraph


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--fp16", action="store_true", help="store floating-point weights in float16 (half the size)")
    a = p.parse_args(argv)
    import torch

    from latte_plugin.storage import CheckpointError, check_readable
    from latte_plugin.mmdet.checkpoint import slim_checkpoint

    try:
        check_readable(a.src)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    slim_checkpoint(a.src, a.dst, torch.float16 if a.fp16 else None)
    print(a.dst)


if __name__ == "__main__":
    main()
