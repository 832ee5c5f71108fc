# Conditional DETR-R50 as transformers has it (microsoft/conditional-detr-resnet-50): 6 encoder + 6 decoder self-attention; cross-attention exact.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_conditional_detr_r50_latte_coco.py model.pretrained=/path/to/hf_dir
import os

from .hf_detector_latte_coco_800 import dataloader, model, train  # noqa: F401

model.family = "conditional_detr"
model.hf_config = "conditional_detr_r50"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "conditional_detr_r50")
