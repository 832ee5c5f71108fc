# The embedded Conditional DETR in detectron2: the same model and checkpoint as the mmdet
# side (configs/mmdet/embedded/cond_detr_r18_synthetic.py), detectron2's own data loader and
# COCOEvaluator on the generated data (python -m latte_plugin.data.synthetic data/synthetic
# --train 4000 --val 300). Exact attention; LATTE: cond_detr_r18_synthetic_latte.py.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/embedded/cond_detr_r18_synthetic.py
import os
import detectron2.data.transforms as T
from detectron2 import model_zoo
from detectron2.config import LazyCall as L
from detectron2.data import DatasetMapper, build_detection_test_loader, get_detection_dataset_dicts
from detectron2.evaluation import COCOEvaluator

from latte_plugin.detectron2 import MMDetDetector, register_synthetic

train_set, val_set = register_synthetic("data/synthetic")

dataloader = model_zoo.get_config("common/data/coco.py").dataloader
dataloader.train.dataset.names = train_set
dataloader.train.mapper.use_instance_mask = False
dataloader.train.mapper.augmentations = [L(T.ResizeShortestEdge)(short_edge_length=256, max_size=256),
                                         L(T.RandomFlip)(horizontal=True)]
dataloader.train.total_batch_size = 8
dataloader.train.num_workers = 1
dataloader.test.dataset.names = val_set
# mmdet's test pipeline: Resize(scale=(256, 256), keep_ratio=True)
test_augmentations = [L(T.ResizeShortestEdge)(short_edge_length=256, max_size=256)]
dataloader.test.mapper.augmentations = test_augmentations
dataloader.test.num_workers = 0
dataloader.evaluator = L(COCOEvaluator)(dataset_name=val_set, output_dir="work_dirs/d2_eval")

model = L(MMDetDetector)(
    mmdet_config=os.path.join(os.path.dirname(__file__), "..", "..", "mmdet", "embedded", "cond_detr_r18_synthetic.py"),
    latte=None,
    # train-split images through the test mapper, for LATTE's calibration (used only with latte=...)
    calibration_loader=L(build_detection_test_loader)(
        dataset=L(get_detection_dataset_dicts)(names=train_set, filter_empty=False),
        mapper=L(DatasetMapper)(is_train=False, augmentations=test_augmentations, image_format="BGR"),
        num_workers=0),
)

train = model_zoo.get_config("common/train.py").train
train.init_checkpoint = "checkpoints/cond_detr_r18_synthetic.pth"
train.device = "cpu"
train.output_dir = "work_dirs/d2_cond_detr"
