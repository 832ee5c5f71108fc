# The embedded RT-DETR in detectron2: the same model (HF RTDetrForObjectDetection, here through
# latte_plugin.detectron2.LatteRTDETR, with no mmdet or mmcv) and checkpoint as
# configs/mmdet/embedded/rtdetr_r18_synthetic.py, detectron2's own data loader and COCOEvaluator.
# Exact attention; LATTE: rtdetr_r18_synthetic_latte.py.
import os
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from latte_plugin.detectron2 import LatteRTDETR

from .cond_detr_r18_synthetic import dataloader, model as _cond_detr, train

# mmdet's test pipeline: Resize(scale=(256, 256), keep_ratio=False)
test_augmentations = [L(T.Resize)(shape=(256, 256))]
dataloader.test.mapper.augmentations = test_augmentations
model = L(LatteRTDETR)(
    # transformers.RTDetrConfig keywords, the same file the mmdet config reads
    hf_config=os.path.join(os.path.dirname(__file__), "..", "..", "hf", "rtdetr_r18_synthetic.json"),
    max_per_img=100,
    latte=None,
    calibration_loader=_cond_detr.calibration_loader,
)
model.calibration_loader.mapper.augmentations = test_augmentations
train.init_checkpoint = "checkpoints/rtdetr_r18_synthetic.pth"
train.output_dir = "work_dirs/d2_rtdetr"
