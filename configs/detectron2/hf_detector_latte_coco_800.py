# The DETR-style evaluation transform of transformers' DETR / YOLOS image processors over
# hf_detector_latte_coco.py: shortest edge 800, longest 1333, no padding beyond the batch.
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from .hf_detector_latte_coco import dataloader, model, train  # noqa: F401

dataloader.test.mapper.augmentations = [L(T.ResizeShortestEdge)(short_edge_length=800, max_size=1333)]
model.calibration_loader.mapper.augmentations = dataloader.test.mapper.augmentations
model.pad_size_divisor = 1
