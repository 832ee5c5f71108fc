# The embedded RT-DETR in detectron2: the same model (HF RTDetrForObjectDetection through
# latte_plugin.mmdet.HFRTDETR) and checkpoint as configs/mmdet/embedded/rtdetr_r18_synthetic.py,
# detectron2's own data loader and COCOEvaluator. Exact attention; LATTE: rtdetr_r18_synthetic_latte.py.
import os
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from latte_plugin.detectron2 import MMDetDetector

from .cond_detr_r18_synthetic import dataloader, model, train

# mmdet's test pipeline: Resize(scale=(256, 256), keep_ratio=False)
test_augmentations = [L(T.Resize)(shape=(256, 256))]
dataloader.test.mapper.augmentations = test_augmentations
model._target_ = MMDetDetector
model.mmdet_config = os.path.join(os.path.dirname(__file__), "..", "..", "mmdet", "embedded", "rtdetr_r18_synthetic.py")
model.calibration_loader.mapper.augmentations = test_augmentations
train.init_checkpoint = "checkpoints/rtdetr_r18_synthetic.pth"
train.output_dir = "work_dirs/d2_rtdetr"
