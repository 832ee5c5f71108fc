# RT-DETR-R50vd on COCO with LATTE on 5 of its 7 attention layers (AIFI + 6 decoder
# self-attention), in detectron2. The model is HF's RTDetrForObjectDetection through
# latte_plugin.detectron2.LatteRTDETR: torch, detectron2 and transformers only (no mmdet, no mmcv).
# Weights: a local HF directory (config.json + model.safetensors), model.pretrained=/path/to/dir,
# or an mmdet/detectron2 checkpoint of the same model as train.init_checkpoint.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/rtdetr_r50vd_latte_coco.py model.pretrained=/path/to/rtdetr_r50vd
import os

import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from latte_plugin.detectron2 import LatteRTDETR
from latte_plugin.hf.rtdetr import RTDETR_CANDIDATES

from .detr_r50_latte_coco import dataloader, model as _detr, train

# RT-DETR's test pipeline: Resize(scale=(640, 640), keep_ratio=False)
dataloader.test.mapper.augmentations = [L(T.Resize)(shape=(640, 640))]
model = L(LatteRTDETR)(
    # a local HF directory (nothing is downloaded), resolved against the repository, not the working dir
    pretrained=os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "rtdetr_r50vd"),
    max_per_img=100,
    latte=dict(_detr.latte, candidates=list(RTDETR_CANDIDATES)),
    calibration_loader=_detr.calibration_loader,
)
model.calibration_loader.mapper.augmentations = dataloader.test.mapper.augmentations
