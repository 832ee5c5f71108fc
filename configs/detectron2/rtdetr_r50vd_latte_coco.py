# RT-DETR-R50vd on COCO with LATTE on 5 of its 7 attention layers (AIFI + 6 decoder
# self-attention), in detectron2. The model is HF's RTDetrForObjectDetection through the
# plugin's mmdet config (configs/mmdet/rtdetr_r50vd_latte_coco.py: point its `pretrained` at a
# local HF weights directory, or give an mmdet/detectron2 checkpoint as train.init_checkpoint).
import os
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from latte_plugin.detectron2 import LatteRTDETR

from .detr_r50_latte_coco import dataloader, model, train

# RT-DETR's test pipeline: Resize(scale=(640, 640), keep_ratio=False)
dataloader.test.mapper.augmentations = [L(T.Resize)(shape=(640, 640))]
model._target_ = LatteRTDETR
model.mmdet_config = os.path.join(os.path.dirname(__file__), "..", "mmdet", "rtdetr_r50vd_latte_coco.py")
# the HF weights directory (config.json + model.safetensors): model.model_overrides.pretrained=/path/to/dir
model.model_overrides = dict(pretrained="checkpoints/hf/rtdetr_r50vd")
model.latte.candidates = ["hf.model.encoder.aifi.*.layers.*.self_attn", "hf.model.decoder.layers.*.self_attn"]
model.calibration_loader.mapper.augmentations = dataloader.test.mapper.augmentations
