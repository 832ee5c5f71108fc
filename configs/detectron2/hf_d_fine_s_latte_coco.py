# D-FINE-S (ustc-community/dfine-small-coco, HGNetV2-B0): LATTE on 67% of AIFI + 3 decoder self-attention layers.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_d_fine_s_latte_coco.py model.pretrained=/path/to/hf_dir
import os

from .hf_detector_latte_coco import dataloader, model, train  # noqa: F401

model.family = "d_fine"
model.hf_config = "d_fine_s"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "d_fine_s")
