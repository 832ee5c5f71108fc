# The base of the transformers detectors on COCO in detectron2 (latte_plugin.detectron2.LatteHFDetector:
# torch, detectron2 and transformers only; no mmdet, no mmcv): detectron2's COCO loaders and
# COCOEvaluator, the RT-DETR-style 640 x 640 evaluation transform, and LATTE on 67% of the global
# softmax attention layers the model has (candidates=["auto"]: found by one probe forward, ViT
# backbone blocks included; windowed and deformable attention stay exact).
# Each family's config sets model.family and its weights:
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/hf_deimv2_dinov3_s_latte_coco.py model.pretrained=/path/to/hf_dir
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from latte_plugin.detectron2 import LatteHFDetector

from .detr_r50_latte_coco import dataloader, model as _detr, train

dataloader.test.mapper.augmentations = [L(T.Resize)(shape=(640, 640))]
model = L(LatteHFDetector)(
    family="rt_detr",
    pretrained=None,  # a local HF directory (config.json + model.safetensors); nothing is downloaded
    max_per_img=100,
    latte=dict(_detr.latte, candidates=["auto"]),
    calibration_loader=_detr.calibration_loader,
)
model.calibration_loader.mapper.augmentations = dataloader.test.mapper.augmentations
