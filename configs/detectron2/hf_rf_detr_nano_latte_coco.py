# RF-DETR Nano (DINOv2-S, windowed): LATTE on 67% of its 3 global ViT blocks + 2 decoder self-attention; windowed blocks stay exact.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_rf_detr_nano_latte_coco.py model.pretrained=/path/to/hf_dir
import os

import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from .hf_detector_latte_coco import dataloader, model, train  # noqa: F401

model.family = "rf_detr"
model.hf_config = "rf_detr_nano"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "rf_detr_nano")
# RF-DETR Nano's image processor: 384 x 384
dataloader.test.mapper.augmentations = [L(T.Resize)(shape=(384, 384))]
model.calibration_loader.mapper.augmentations = dataloader.test.mapper.augmentations
