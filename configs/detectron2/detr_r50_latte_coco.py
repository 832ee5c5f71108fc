# DETR-R50 on COCO with LATTE on 4 of its 6 encoder self-attention layers, in detectron2.
# The model is mmdet's DETR (same checkpoint as configs/mmdet/detr_r50_latte_coco.py); the data
# loader and COCOEvaluator are detectron2's (upstream common/data/coco.py).
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/detr_r50_latte_coco.py train.init_checkpoint=/path/to/detr_r50.pth
# Overrides: model.latte.ratio=0.5 model.latte.variant=jpn_only model.latte.num_images=64 ...
import detectron2.data.transforms as T
from detectron2 import model_zoo
from detectron2.config import LazyCall as L
from detectron2.data import DatasetMapper, build_detection_test_loader, get_detection_dataset_dicts

from latte_plugin.detectron2 import LatteDETR

dataloader = model_zoo.get_config("common/data/coco.py").dataloader
dataloader.train.mapper.use_instance_mask = False
# mmdet's DETR test pipeline: Resize(scale=(1333, 800), keep_ratio=True)
dataloader.test.mapper.augmentations = [L(T.ResizeShortestEdge)(short_edge_length=800, max_size=1333)]

model = L(LatteDETR)(
    mmdet_config="mmdet::detr/detr_r50_8xb2-150e_coco.py",
    latte=dict(candidates=["encoder.layers.*.self_attn"], ratio=0.67, variant="latte", num_images=64),
    calibration_loader=L(build_detection_test_loader)(
        dataset=L(get_detection_dataset_dicts)(names="coco_2017_train", filter_empty=False),
        mapper=L(DatasetMapper)(is_train=False, augmentations=dataloader.test.mapper.augmentations,
                                image_format="BGR"),
        num_workers=2),
)

train = model_zoo.get_config("common/train.py").train
train.init_checkpoint = ""  # your DETR-R50 checkpoint (mmdet or detectron2 format)
