# YOLOS-tiny (hustvl/yolos-tiny): LATTE on 67% of its 12 global ViT blocks (patches + 100 detection tokens).
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_yolos_tiny_latte_coco.py model.pretrained=/path/to/hf_dir
import os

from .hf_detector_latte_coco_800 import dataloader, model, train  # noqa: F401

model.family = "yolos"
model.hf_config = "yolos_tiny"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "yolos_tiny")
