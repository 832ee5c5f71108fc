# RT-DETR-R18vd (PekingU/rtdetr_r18vd): LATTE on 67% of its 4 global attention layers (AIFI + 3 decoder self-attention).
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_rt_detr_r18vd_latte_coco.py model.pretrained=/path/to/hf_dir
import os

from .hf_detector_latte_coco import dataloader, model, train  # noqa: F401

model.family = "rt_detr"
model.hf_config = "rt_detr_r18vd"  # the architecture (latte_plugin/resources/architectures), for model.pretrained=None: random weights
# an HF directory of this model (config.json + model.safetensors), resolved against the repository
model.pretrained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "hf", "rt_detr_r18vd")
