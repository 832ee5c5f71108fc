# DEIMv2-S (Intellindust/DEIMv2_DINOv3_S_COCO): LATTE on 67% of 17 layers: the 12 DINOv3 ViT blocks (RoPE), AIFI, 4 decoder self-attention.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_deimv2_dinov3_s_latte_coco.py model.pretrained=/path/to/hf_dir
import os

from .hf_detector_latte_coco import dataloader, model, train  # noqa: F401

model.family = "deimv2"
model.hf_config = "deimv2_dinov3_s"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "deimv2_dinov3_s")
