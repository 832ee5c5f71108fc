# LW-DETR tiny: LATTE on 67% of its 3 global ViT blocks + 3 decoder self-attention; the 3 windowed blocks stay exact.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_lw_detr_tiny_latte_coco.py model.pretrained=/path/to/hf_dir
import os

from .hf_detector_latte_coco import dataloader, model, train  # noqa: F401

model.family = "lw_detr"
model.hf_config = "lw_detr_tiny"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "lw_detr_tiny")
